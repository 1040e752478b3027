"""KernelPolicy: which kernel runs each op, as data."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._errors import PolicyError, shown
from ._choices import KERNEL_ALIASES, KERNEL_CHOICES, choose, choose_strategy
from ._document import fingerprint_of, read_document, unknown_fields, write_document

__all__ = ["FIELDS", "KernelPolicy"]

_SCHEMA = "xpuruntime.kernel_policy/1"
_STEP_PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "fp8_rowwise")
FIELDS = ("schema", "auto_strategy", "strict", "deterministic", "tf32", "precision",
          "cuda_graph", "autocast_norms", "offload_activations", "fp8_base",
          "fp8_activations", "packed_sequences", "graph_layers", "kernels", "frozen")  # fmt: skip
"""The fields of a kernel policy document."""


class KernelPolicy:
    """Which kernel runs each op: ``op -> kernel`` preferences plus an auto strategy.

    Parameters
    ----------
    auto_strategy : {'first_supported', 'best_performance'}
        How the dispatcher chooses for ops the policy leaves to ``auto`` (or does not
        name): the first candidate that supports the call, or the fastest one, measured
        once per shape class and cached on disk.
    strict : bool
        Raise :class:`~xpuruntime.UnsupportedOperationError` when a named kernel cannot
        run, instead of falling back (with a warning) to the next supported one.
    deterministic : bool
        Run only deterministic kernels (PyTorch's deterministic algorithms, no cuDNN
        autotuning, no non-deterministic attention backward).
    tf32 : bool or None
        Allow TF32 for fp32 matmuls and convolutions (True), forbid it (False), or leave
        PyTorch's setting alone (None).
    precision : {'bf16', 'fp16', 'fp32', 'fp8', 'fp8_rowwise'} or None
        The compute precision of a training step built from the policy
        (``xpuruntime.pytorch.make_train_step``): autocast to bf16/fp16, or none (fp32).
        ``fp8`` and ``fp8_rowwise`` autocast to bf16 and run the GEMMs of an optimized
        model's linear layers (joined projections, and the others large enough) with
        FP8 operands (``torch._scaled_mm``), scaled per tensor (the gradients in e5m2)
        or per row (all e4m3; the weight gradient's GEMM in bf16), where the GPU has
        FP8 (compute capability 8.9 or newer) and the shape pays; a CPU or an older GPU
        runs bf16 and says so, or raises ``BackendUnavailableError`` under ``strict``.
        None leaves it to the caller.
    cuda_graph : bool
        Capture a training step built from the policy as one CUDA graph.
    autocast_norms : bool
        Under autocast, layer and RMS norms routed by the policy return the autocast
        dtype (still computed in fp32) instead of the kernel's own output dtype (fp32 for
        PyTorch's on CUDA). That is what a following ``nn.Linear`` casts to anyway, so a
        norm feeding a projection saves a cast in forward and backward. Leave it off when
        a norm's output feeds fp32 work, such as a post-norm residual stream.
    offload_activations : bool
        Under gradient checkpointing, move each checkpointed layer's input to pinned
        host memory in the forward and bring it back ahead of the layer's backward, on a
        side stream (``xpuruntime.pytorch.optimize`` applies it).
    fp8_base : bool
        Under ``precision='fp8'`` or ``'fp8_rowwise'``, ``optimize`` stores the frozen
        bases of the LoRA layers it fuses once in FP8 (e4m3, a scale per output row). They
        take half the memory, and the ``lora_linear`` op's FP8 GEMMs read them with no
        cast per call. The stored values are rounded; ``revert`` gives those back. Without
        an FP8 GPU and precision the bases stay as they are and the report says why
        (under ``strict``: ``BackendUnavailableError`` or ``PolicyError``).
    fp8_activations : bool
        Under ``precision='fp8'`` or ``'fp8_rowwise'``, the gated MLPs' activation
        (``swiglu``, ``geglu``) keeps gate and up for the backward in FP8 (e4m3, a scale
        per row), not in 16 bits. They are the largest activations a layer keeps (57 of
        about 100 KB a token and layer at Llama-3.1-8B's width); half of that is saved.
        The backward and the next projection's gradient read the rounded values.
        Without an FP8 precision or GPU the inputs stay as they are and the report says
        why (under ``strict``: ``PolicyError`` or ``BackendUnavailableError``).
    packed_sequences : bool
        Every batch given ``position_ids`` (and no attention mask or cache) holds packed
        sequences, as TRL's padding-free rows do: each run of consecutive positions is a
        document. ``optimize`` then makes a model's documents from its positions on the
        device. transformers reads them on the host to find out whether the batch is
        packed, a wait for the GPU in every forward. So the host queues ahead, and
        nothing in the mask keeps a CUDA-graphed step (``cuda_graph``) from capturing
        packed batches. A batch that is not packed computes the same: one document a
        row, causal attention by our kernel. On long rows that is slower than cuDNN's,
        which it would have run. A sliding window's mask is made from the same
        documents. Our attention kernel reads the documents where it runs (``attention``
        left to auto or ``triton``). Another kernel gets the block-diagonal mask, made
        from them on the device, as dense as transformers' own. The report says where
        it applies.
    graph_layers : bool
        In training on a CUDA device, each decoder layer of the model ``optimize`` is given
        replays CUDA graphs of its forward and of its backward. They are captured at the
        layer's first call of each input signature. A plain loop or ``Trainer`` then
        launches two graphs a layer, not each kernel from Python: for small models whose
        host work outruns the GPU. The graphs keep each signature's memory. Under
        gradient checkpointing, ``torch.distributed`` or ``torch.compile`` a layer runs
        as written (logged). A layer's output is rewritten by its next graphed call.
    **op_kernels : str
        ``op=kernel`` pairs, for example ``matmul="cublasLt"``. Names are matched
        case-insensitively and stored in their canonical spelling.

    Notes
    -----
    A policy can also carry **frozen decisions** (:meth:`freeze`, or
    ``xpuruntime.pytorch.freeze_kernel_policy()`` after a run): for an op it leaves to
    ``auto``, the kernel to run on calls of one shape class, as chosen before (measured
    under ``best_performance`` on some machine). Saved and loaded with the policy, they
    make another process or machine run the same kernels without measuring: the seed
    documents' "same policy, same execution". A kernel the policy names for the op
    takes precedence; shape classes not frozen are decided by ``auto_strategy``.

    Raises
    ------
    PolicyError
        For an unknown op, kernel or strategy; the message lists the valid choices.

    Examples
    --------
    >>> policy = KernelPolicy(matmul="cublasLt").set("attention", "flash_v2")
    >>> policy.preferences
    {'attention': 'flash_v2', 'matmul': 'cublasLt'}
    >>> KernelPolicy.from_dict(policy.to_dict()) == policy
    True
    """

    def __init__(
        self,
        *,
        auto_strategy: str = "first_supported",
        strict: bool = False,
        deterministic: bool = False,
        tf32: bool | None = None,
        precision: str | None = None,
        cuda_graph: bool = False,
        autocast_norms: bool = False,
        offload_activations: bool = False,
        fp8_base: bool = False,
        fp8_activations: bool = False,
        packed_sequences: bool = False,
        graph_layers: bool = False,
        **op_kernels: str,
    ) -> None:
        self._preferences: dict[str, str] = {}
        self._frozen: dict[tuple[str, str], dict[str, Any]] = {}
        self.auto_strategy = auto_strategy
        self.strict = strict
        self.deterministic = deterministic
        self.tf32 = tf32
        self.precision = precision
        self.cuda_graph = cuda_graph
        self.autocast_norms = autocast_norms
        self.offload_activations = offload_activations
        self.fp8_base = fp8_base
        self.fp8_activations = fp8_activations
        self.packed_sequences = packed_sequences
        self.graph_layers = graph_layers
        for op, kernel in op_kernels.items():
            self.set(op, kernel)

    # -- queries -----------------------------------------------------------------
    @property
    def preferences(self) -> dict[str, str]:
        """A copy of the ``op -> kernel`` mapping, sorted by op."""
        return dict(sorted(self._preferences.items()))

    @property
    def auto_strategy(self) -> str:
        """``'first_supported'`` or ``'best_performance'``."""
        return self._auto_strategy

    @auto_strategy.setter
    def auto_strategy(self, value: str) -> None:
        self._auto_strategy = choose_strategy(value)

    @property
    def strict(self) -> bool:
        """Whether a kernel the policy names must run (no fallback)."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = _flag("strict", value)

    @property
    def deterministic(self) -> bool:
        """Whether only deterministic kernels may run."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self._deterministic = _flag("deterministic", value)

    @property
    def tf32(self) -> bool | None:
        """TF32 for fp32 matmuls/convolutions: allowed, forbidden, or None (left alone)."""
        return self._tf32

    @tf32.setter
    def tf32(self, value: bool | None) -> None:
        self._tf32 = None if value is None else _flag("tf32", value)

    @property
    def precision(self) -> str | None:
        """A training step's compute precision (``'bf16'``, ``'fp16'``, ``'fp32'``,
        ``'fp8'``, ``'fp8_rowwise'``) or None."""
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        self._precision = None if value is None else choose("precision", value, _STEP_PRECISIONS)

    @property
    def cuda_graph(self) -> bool:
        """Whether a training step built from the policy is captured as a CUDA graph."""
        return self._cuda_graph

    @cuda_graph.setter
    def cuda_graph(self, value: bool) -> None:
        self._cuda_graph = _flag("cuda_graph", value)

    @property
    def autocast_norms(self) -> bool:
        """Whether norms return the autocast dtype under autocast."""
        return self._autocast_norms

    @autocast_norms.setter
    def autocast_norms(self, value: bool) -> None:
        self._autocast_norms = _flag("autocast_norms", value)

    @property
    def offload_activations(self) -> bool:
        """Whether checkpointed layers' inputs wait in pinned host memory."""
        return self._offload_activations

    @offload_activations.setter
    def offload_activations(self, value: bool) -> None:
        self._offload_activations = _flag("offload_activations", value)

    @property
    def graph_layers(self) -> bool:
        """Whether an optimized model's decoder layers replay CUDA graphs in training."""
        return self._graph_layers

    @graph_layers.setter
    def graph_layers(self, value: bool) -> None:
        self._graph_layers = _flag("graph_layers", value)

    @property
    def fp8_base(self) -> bool:
        """Whether fused LoRA layers' frozen bases are stored in FP8."""
        return self._fp8_base

    @fp8_base.setter
    def fp8_base(self, value: bool) -> None:
        self._fp8_base = _flag("fp8_base", value)

    @property
    def fp8_activations(self) -> bool:
        """Whether the gated MLPs' activation keeps its inputs in FP8 for the backward."""
        return self._fp8_activations

    @fp8_activations.setter
    def fp8_activations(self, value: bool) -> None:
        self._fp8_activations = _flag("fp8_activations", value)

    @property
    def packed_sequences(self) -> bool:
        """Whether batches given positions are read as packed sequences, their documents
        made on the device."""
        return self._packed_sequences

    @packed_sequences.setter
    def packed_sequences(self, value: bool) -> None:
        self._packed_sequences = _flag("packed_sequences", value)

    def get(self, op: str) -> str | None:
        """The kernel named for ``op``, or None when the policy leaves it open."""
        return self._preferences.get(_op_name(op))

    @property
    def frozen(self) -> list[dict[str, Any]]:
        """The frozen decisions, each ``{"op", "shape_class", "kernel", "reason"}``,
        sorted by op and shape class (copies)."""
        return [dict(self._frozen[key]) for key in sorted(self._frozen)]

    def frozen_for(self, op: str, shape_class: dict[str, Any]) -> dict[str, Any] | None:
        """The decision frozen for ``op`` on calls of ``shape_class`` (a copy), or None."""
        if not self._frozen:
            return None
        entry = self._frozen.get((op, _canonical(shape_class)))
        return None if entry is None else dict(entry)

    # -- edits (chainable) -------------------------------------------------------
    def set(self, op: str, kernel: str) -> KernelPolicy:
        """Name ``kernel`` for ``op``; returns the policy for chaining.

        The seed documents' names are accepted: ``conv="cudnn"`` is ``"default"``
        (PyTorch's cuDNN convolutions, its settings kept), and ``attention="torch"``
        leaves the op to PyTorch's own choice, as not naming it does.
        """
        op = _op_name(op)
        if isinstance(kernel, str) and (op, kernel.lower()) in KERNEL_ALIASES:
            alias = KERNEL_ALIASES[(op, kernel.lower())]
            if alias is None:
                return self.remove(op)
            kernel = alias
        self._preferences[op] = choose(f"kernel for op {shown(op)}", kernel, KERNEL_CHOICES[op])
        return self

    def freeze(
        self, op: str, shape_class: dict[str, Any], kernel: str, reason: str = ""
    ) -> KernelPolicy:
        """Run ``kernel`` for ``op`` on calls of ``shape_class`` (as an op's context
        describes them, for example ``{"dtype": "bf16", "hidden": 2048, "rows": 8192}``)
        whenever the policy leaves ``op`` to ``auto``; ``reason`` says why it was chosen
        (kept for the log). Returns the policy for chaining."""
        op = _op_name(op)
        kernel = choose(f"frozen kernel for op {shown(op)}", kernel, KERNEL_CHOICES[op])
        if not isinstance(shape_class, dict):
            raise PolicyError(
                f"frozen decision for {op}: shape_class must be a mapping, got "
                f"{type(shape_class).__name__}"
            )
        if not isinstance(reason, str):
            raise PolicyError(f"frozen decision for {op}: reason must be text, got {shown(reason)}")
        key = _canonical(shape_class)
        self._frozen[(op, key)] = {
            "op": op, "shape_class": json.loads(key), "kernel": kernel, "reason": reason,
        }  # fmt: skip
        return self

    def remove(self, op: str) -> KernelPolicy:
        """Forget the choice for ``op`` (no error if none was set); returns the policy."""
        self._preferences.pop(_op_name(op), None)
        return self

    # -- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The canonical, JSON-ready form (with a schema version)."""
        return {
            "schema": _SCHEMA,
            "auto_strategy": self._auto_strategy,
            "strict": self._strict,
            "deterministic": self._deterministic,
            "tf32": self._tf32,
            "precision": self._precision,
            "cuda_graph": self._cuda_graph,
            "autocast_norms": self._autocast_norms,
            # Only when on, so that the fingerprints of policies without it stay as they were.
            **({"offload_activations": True} if self._offload_activations else {}),
            **({"fp8_base": True} if self._fp8_base else {}),
            **({"fp8_activations": True} if self._fp8_activations else {}),
            **({"packed_sequences": True} if self._packed_sequences else {}),
            **({"graph_layers": True} if self._graph_layers else {}),
            "kernels": self.preferences,
            **({"frozen": self.frozen} if self._frozen else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> KernelPolicy:
        """Build a policy from :meth:`to_dict` output, or from the seed documents' form
        ``{"preferences": {op: kernel}, "auto_strategy": ...}``; ``source`` names it in
        errors."""
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a mapping, got {type(data).__name__}")
        if "preferences" in data and "kernels" not in data and "schema" not in data:
            data = {**data, "kernels": data["preferences"]}
            del data["preferences"]
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise PolicyError(f"{source}: {unknown_fields(unknown, FIELDS)}")
        schema = data.get("schema", _SCHEMA)
        if schema != _SCHEMA:
            raise PolicyError(f"{source}: schema {shown(schema)} is not {shown(_SCHEMA)}")
        kernels = data.get("kernels", {})
        if not isinstance(kernels, dict):
            raise PolicyError(
                f"{source}: 'kernels' must map op to kernel, got {type(kernels).__name__}"
            )
        frozen = data.get("frozen", [])
        if not isinstance(frozen, list):
            raise PolicyError(
                f"{source}: 'frozen' must be a list of decisions, got {type(frozen).__name__}"
            )
        try:
            policy = cls(
                auto_strategy=data.get("auto_strategy", "first_supported"),
                strict=data.get("strict", False),
                deterministic=data.get("deterministic", False),
                tf32=data.get("tf32"),
                precision=data.get("precision"),
                cuda_graph=data.get("cuda_graph", False),
                autocast_norms=data.get("autocast_norms", False),
                offload_activations=data.get("offload_activations", False),
                fp8_base=data.get("fp8_base", False),
                fp8_activations=data.get("fp8_activations", False),
                packed_sequences=data.get("packed_sequences", False),
                graph_layers=data.get("graph_layers", False),
                **kernels,
            )
            for i, entry in enumerate(frozen):
                names = ("op", "shape_class", "kernel", "reason")
                if not isinstance(entry, dict) or not {"op", "shape_class", "kernel"} <= set(
                    entry
                ) <= set(names):
                    raise PolicyError(
                        f"frozen decision {i}: expected a mapping with 'op', 'shape_class', "
                        f"'kernel' and optionally 'reason', got {shown(entry)}"
                    )
                policy.freeze(*(entry.get(name, "") for name in names))
        except PolicyError as e:
            raise PolicyError(f"{source}: {e}") from None
        return policy

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KernelPolicy:
        """Parse :meth:`to_json` output."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(f"policy JSON is malformed: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str], format: str | None = None) -> Path:
        """Write the policy atomically as JSON or YAML (by ``format`` or the suffix)."""
        return write_document(path, self.to_dict(), format)

    @classmethod
    def load(cls, path: str | os.PathLike[str], format: str | None = None) -> KernelPolicy:
        """Read a policy written by :meth:`save` (or by hand, in JSON or YAML)."""
        return cls.from_dict(read_document(path, format), source=str(path))

    def fingerprint(self) -> str:
        """A stable hash of the canonical form; equal policies have equal fingerprints."""
        return fingerprint_of(self.to_dict())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KernelPolicy):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        pairs = [f"{op}={shown(kernel)}" for op, kernel in self.preferences.items()]
        if self._auto_strategy != "first_supported":
            pairs.append(f"auto_strategy={shown(self._auto_strategy)}")
        pairs += [
            f"{name}=True"
            for name in (
                "strict",
                "deterministic",
                "cuda_graph",
                "autocast_norms",
                "offload_activations",
                "fp8_base",
                "fp8_activations",
                "packed_sequences",
                "graph_layers",
            )
            if getattr(self, name)
        ]
        if self._tf32 is not None:
            pairs.append(f"tf32={self._tf32}")
        if self._precision is not None:
            pairs.append(f"precision={shown(self._precision)}")
        if self._frozen:
            pairs.append(f"<{len(self._frozen)} frozen decision(s)>")
        return f"KernelPolicy({', '.join(pairs)})"


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{name}: expected True or False, got {shown(value)}")
    return value


def _op_name(op: str) -> str:
    return choose("op", op, KERNEL_CHOICES)


def _canonical(shape_class: dict[str, Any]) -> str:
    """A shape class as canonical JSON (tuples and lists alike, keys sorted)."""
    try:
        return json.dumps(shape_class, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"a frozen decision's shape_class must be plain JSON data: {e}") from None

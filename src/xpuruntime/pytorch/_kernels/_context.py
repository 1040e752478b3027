"""What a PyTorch kernel is asked to run: the op's device, dtype, shapes and flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "LoraContext",
    "ActivationContext",
    "AttentionContext",
    "DeviceContext",
    "LinearContext",
    "LossContext",
    "NormContext",
    "ProjectionsContext",
    "ResidualNormContext",
    "RopeContext",
    "dtype_name",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``'bfloat16'`` for ``torch.bfloat16``: how logs and timing keys spell a dtype."""
    return str(dtype).removeprefix("torch.")


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class DeviceContext:
    """A process-wide choice (matmul, conv): only the device and determinism matter."""

    device: torch.device
    deterministic: bool = False

    @property
    def summary(self) -> dict[str, Any]:
        return {"device": str(self.device), "deterministic": self.deterministic}


@dataclass(frozen=True)
class AttentionContext:
    """One attention call's inputs, as PyTorch's SDPA backend probes see them."""

    query: torch.Tensor = field(repr=False)
    key: torch.Tensor = field(repr=False)
    value: torch.Tensor = field(repr=False)
    attn_mask: torch.Tensor | None = field(repr=False)
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    deterministic: bool

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def head_dim(self) -> int:
        return self.query.shape[-1]

    @property
    def requires_grad(self) -> bool:
        tensors = (self.query, self.key, self.value)
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    @property
    def shape_class(self) -> dict[str, Any]:
        """What best_performance timings are keyed by: sequence lengths rounded up to a
        power of two, everything else exact."""
        batch, heads, seq_q, head_dim = self.query.shape
        return {
            "dtype": dtype_name(self.dtype),
            "batch": batch,
            "heads": heads,
            "kv_heads": self.key.shape[1],
            "seq_q": _bucket(seq_q),
            "seq_k": _bucket(self.key.shape[2]),
            "head_dim": head_dim,
            "causal": self.is_causal,
            "mask": None if self.attn_mask is None else str(self.attn_mask.dtype),
            "dropout": self.dropout_p > 0,
            "grad": self.requires_grad,
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "shapes": [list(self.query.shape), list(self.key.shape), list(self.value.shape)],
            "is_causal": self.is_causal,
            "attn_mask": None if self.attn_mask is None else list(self.attn_mask.shape),
            "dropout_p": self.dropout_p,
            "requires_grad": self.requires_grad,
            "deterministic": self.deterministic,
        }


@dataclass(frozen=True)
class NormContext:
    """One normalisation call (``layernorm`` or ``rmsnorm``) over the trailing
    ``normalized_shape``."""

    input: torch.Tensor = field(repr=False)
    normalized_shape: tuple[int, ...]
    has_weight: bool
    has_bias: bool
    deterministic: bool

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input.dtype

    @property
    def width(self) -> int:
        """Elements per normalised row."""
        width = 1
        for d in self.normalized_shape:
            width *= d
        return width

    @property
    def rows(self) -> int:
        return self.input.numel() // max(1, self.width)

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and self.input.requires_grad

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by the exact width and the row count rounded up to a power
        of two."""
        return {
            "dtype": dtype_name(self.dtype),
            "width": self.width,
            "rows": _bucket(self.rows),
            "weight": self.has_weight,
            "bias": self.has_bias,
            "grad": self.requires_grad,
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "shapes": [list(self.input.shape)],
            "width": self.width,
            "requires_grad": self.requires_grad,
        }


@dataclass(frozen=True)
class ResidualNormContext(NormContext):
    """A residual add ``input + branch`` followed by the norm of its sum."""

    branch: torch.Tensor = field(repr=False)

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.input.requires_grad or self.branch.requires_grad)

    @property
    def shape_class(self) -> dict[str, Any]:
        return {**super().shape_class, "branch_dtype": dtype_name(self.branch.dtype)}


@dataclass(frozen=True)
class LinearContext:
    """One linear layer: ``input`` (..., in_features) through a weight (out, in) whose
    GEMMs run in ``compute_dtype`` (the autocast dtype under autocast)."""

    input: torch.Tensor = field(repr=False)
    out_features: int
    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    has_bias: bool
    deterministic: bool
    approximate: str | None = None  # the GELU after the layer (linear_gelu)

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def rows(self) -> int:
        return self.input.numel() // max(1, self.input.shape[-1])

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled()

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by dtypes, features and the rows rounded up to a power of
        two."""
        return {
            "dtype": dtype_name(self.compute_dtype),
            "param_dtype": dtype_name(self.param_dtype),
            "in": self.input.shape[-1],
            "out": self.out_features,
            "rows": _bucket(self.rows),
            "bias": self.has_bias,
            "grad": self.requires_grad,
            **({} if self.approximate is None else {"gelu": self.approximate}),
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.compute_dtype),
            "param_dtype": dtype_name(self.param_dtype),
            "shapes": [list(self.input.shape), [self.out_features, self.input.shape[-1]]],
            "requires_grad": self.requires_grad,
            **({} if self.approximate is None else {"gelu": self.approximate}),
        }


@dataclass(frozen=True)
class MLPContext(LinearContext):
    """A transformer's MLP: the linear layer of :class:`LinearContext` (``out_features``
    its hidden width), GELU, and a second linear layer to ``proj_out_features``."""

    proj_out_features: int = 0

    @property
    def shape_class(self) -> dict[str, Any]:
        return {**super().shape_class, "proj_out": self.proj_out_features}

    @property
    def summary(self) -> dict[str, Any]:
        summary = super().summary
        summary["shapes"].append([self.proj_out_features, self.out_features])
        return summary


@dataclass(frozen=True)
class ProjectionsContext(LinearContext):
    """Linear layers of one input (``projections``): :class:`LinearContext` with
    ``out_features`` their joined width and ``sizes`` each one's."""

    sizes: tuple[int, ...] = ()

    @property
    def shape_class(self) -> dict[str, Any]:
        return {**super().shape_class, "outs": list(self.sizes)}

    @property
    def summary(self) -> dict[str, Any]:
        summary = super().summary
        summary["shapes"][1:] = [[n, self.input.shape[-1]] for n in self.sizes]
        return summary


@dataclass(frozen=True)
class LossContext:
    """One language-model loss: hidden states (rows, H) through a (V, H) head into
    ``F.cross_entropy``."""

    hidden: torch.Tensor = field(repr=False)
    vocab: int
    dtype: torch.dtype
    reduction: str
    unsupported_arguments: tuple[str, ...]
    transform: tuple[float, float | None] = (1.0, None)
    """What the model did to its logits before the loss: ``(scale, softcap)``, each
    logit ``z`` taken as ``z * scale``, then ``softcap * tanh(z / softcap)``."""

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def rows(self) -> int:
        return self.hidden.numel() // max(1, self.hidden.shape[-1])

    @property
    def softcap(self) -> float | None:
        return self.transform[1]

    @property
    def requires_grad(self) -> bool:
        """A loss is timed forward and backward."""
        return True

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by dtype, hidden size, vocabulary and the rows rounded up to
        a power of two."""
        return {
            "dtype": dtype_name(self.dtype),
            "hidden": self.hidden.shape[-1],
            "vocab": self.vocab,
            "rows": _bucket(self.rows),
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "shapes": [list(self.hidden.shape), [self.vocab, self.hidden.shape[-1]]],
            "reduction": self.reduction,
            **({} if self.transform == (1.0, None) else {"logits": _transform(*self.transform)}),
        }


def _transform(scale: float, softcap: float | None) -> str:
    scaled = "z" if scale == 1.0 else f"z * {scale:g}"
    return scaled if softcap is None else f"{softcap:g} * tanh({scaled} / {softcap:g})"


@dataclass(frozen=True)
class ActivationContext:
    """A gated activation (``swiglu``, ``geglu``) of two tensors shaped alike, or
    (``packed``) of one holding both as the halves of its last dimension."""

    gate: torch.Tensor = field(repr=False)
    requires_grad: bool
    packed: bool = False
    fp8_kept: bool = False  # the policy's fp8_activations: gate and up kept in FP8

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by dtype, the last dimension and the element count rounded
        up to a power of two."""
        return {
            "dtype": dtype_name(self.dtype),
            "width": self.gate.shape[-1] if self.gate.dim() else 1,
            "elements": _bucket(self.gate.numel()),
            "grad": self.requires_grad,
            **({"packed": True} if self.packed else {}),
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "shapes": [list(self.gate.shape)] * (1 if self.packed else 2),
            "requires_grad": self.requires_grad,
        }


@dataclass(frozen=True)
class RopeContext:
    """Rotary position embedding (``rope``) of queries ``q`` and keys ``k``."""

    q: torch.Tensor = field(repr=False)
    k: torch.Tensor = field(repr=False)
    interleaved: bool
    requires_grad: bool

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by dtype, head width, head counts, the layout and the token
        count rounded up to a power of two."""
        batch, heads, tokens, width = self.q.shape
        return {
            "dtype": dtype_name(self.dtype),
            "head_dim": width,
            "heads": [heads, self.k.shape[1]],
            "tokens": _bucket(batch * tokens),
            "interleaved": self.interleaved,
            "grad": self.requires_grad,
        }

    @property
    def summary(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "shapes": [list(self.q.shape), list(self.k.shape)],
            "interleaved": self.interleaved,
            "requires_grad": self.requires_grad,
        }


@dataclass(frozen=True)
class LoraContext:
    """Linear layers with LoRA adapters (``lora_linear``), one or several of one input:
    ``input`` (..., in_features) through base weights of ``out_features`` in all and
    adapters of ``rank`` in all, the GEMMs in ``compute_dtype``."""

    input: torch.Tensor = field(repr=False)
    out_features: int
    rank: int
    compute_dtype: torch.dtype
    has_bias: bool
    trains_base: bool  # the base weights take a gradient (not frozen)
    layers: int = 1  # LoRA layers of one input run together (q/k/v; gate and up)
    ranks: tuple[int, ...] = ()  # each adapter's
    dropout: tuple[float, ...] = ()  # each adapter's probability on this call (none: no dropout)
    quantized: bool = False  # a 4-bit base (QLoRA's)
    four_bit_fp8: str | None = None  # a 4-bit base: why it is not made FP8 (None: it is)
    stored_fp8: bool = False  # a base stored in FP8 (the policy's fp8_base)

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled()

    @property
    def rows(self) -> int:
        return self.input.numel() // max(1, self.input.shape[-1])

    @property
    def shape_class(self) -> dict[str, Any]:
        """Timings are keyed by the dtype, features, rank and the rows rounded up to a
        power of two."""
        return {
            "dtype": dtype_name(self.compute_dtype),
            "in": self.input.shape[-1],
            "out": self.out_features,
            "rank": self.rank,
            "layers": self.layers,
            "rows": _bucket(self.rows),
            "bias": self.has_bias,
            "base_grad": self.trains_base,
            "grad": self.requires_grad,
        }

"""One :func:`~xpuruntime.pytorch.optimize` call's working state, which every pattern
reads and acts through: the policy in force as the patterns read it, each module's
probes asked once, the user's filter, and the report with its one undo log."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._errors import BackendUnavailableError, UnsupportedOperationError
from ...policies import KernelPolicy
from .._ops._infra._launch import _TRITON_INSTALLED
from .._selection._policy import get_kernel_policy
from ._probes import rms_norm_match
from ._report import OptimizationReport

__all__ = ["Run"]

# The ops whose fusions need Triton: their patterns import its kernels' modules.
_TRITON_PATTERNS = (
    "swiglu", "geglu", "rope", "residual_rmsnorm", "residual_layernorm", "linear_gelu", "mlp",
    "projections", "cross_entropy", "rmsnorm_rope",
)  # fmt: skip


class Run:
    """The state one ``optimize(model, ...)`` call's patterns share.

    Parameters
    ----------
    model : nn.Module
        The model being optimized.
    report : OptimizationReport
        Where the patterns report, and log their undo.
    filter : callable, optional
        ``filter(module, path)``: False leaves that module as written.
    """

    def __init__(
        self,
        model: nn.Module,
        report: OptimizationReport,
        filter: Callable[[nn.Module, str], bool] | None = None,
    ) -> None:
        self.model = model
        self.report = report
        self.policy: KernelPolicy | None = get_kernel_policy()
        self._named = self.policy.get if self.policy is not None else (lambda op: None)
        self.triton = _TRITON_INSTALLED
        if not self.triton:
            self._named = self._without(
                "Triton is not installed (pip install triton)", BackendUnavailableError
            )
        elif (dtypes := _other_float_dtypes(model)) is not None:
            self._named = self._without(
                f"the model's parameters are {dtypes}, and the fused ops take fp32, fp16 and "
                "bf16", UnsupportedOperationError,
            )  # fmt: skip
        self._filter = filter
        self.norm_match = functools.lru_cache(maxsize=None)(rms_norm_match)
        self._memo: dict[Any, Any] = {}
        self.joined: set[int] = set()
        """The ids of the linear layers whose GEMMs an op of a pattern runs (the joined
        projections, a fused LoRA layer's base and adapters): a later swap leaves them to
        that op."""

    def named(self, op: str) -> str | None:
        """The kernel the policy names for ``op`` (None: auto, or no policy); ``torch`` for
        the fused ops where Triton is not installed."""
        return self._named(op)

    def fuses(self, op: str) -> bool:
        """Whether a pattern binds ``op``: unless the policy names PyTorch's expression
        (under auto, as the norms, the op decides per call)."""
        return self._named(op) != "torch"

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, once per run (what a pattern computes over the whole model)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def chosen(self, module: nn.Module, path: str) -> bool:
        """Whether the user's filter leaves ``module`` to the patterns."""
        return self._filter is None or bool(self._filter(module, path))

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        """The model's decoder layers (transformers' ``GradientCheckpointingLayer``s) that
        the user's filter leaves to the patterns, with their paths."""
        return [
            (path, module)
            for path, module in self.model.named_modules()
            if any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
            and self.chosen(module, path)
        ]

    def bind(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Bind ``forward`` on ``module`` (this instance only), undone by revert.

        Named ``forward``: pickle saves a bound method as its object and its function's
        name, so that ``torch.save(model)`` loads with the class's own forward there
        (the same computation; ``optimize`` fuses the loaded model again)."""
        forward.__name__ = "forward"
        module.forward = types.MethodType(forward, module)
        self.report.on_revert(lambda: module.__dict__.pop("forward", None))

    def swap(
        self, path: str, parent: nn.Module, name: str, new: nn.Module, was: str, now: str
    ) -> None:
        """Put ``new`` in place of ``parent.<name>``, undone by revert."""
        old = getattr(parent, name)
        _refuse_sharded(path, old)
        setattr(parent, name, new)
        self.report.swapped(path, parent, name, old, was, now)

    def skip(self, path: str, why: str) -> None:
        """Report ``path`` as considered and left as written, and why."""
        self.report.skipped.append((path, why))

    def _without(self, why: str, error: type[Exception]) -> Callable[[str], str | None]:
        """Where the fused ops cannot run (no Triton: a CPU-only PyTorch install, macOS;
        or a model in a dtype they do not take): the fusions are left as written and the
        report says so; the norms are still replaced, and run PyTorch's kernels. Under
        ``strict`` that is ``error`` instead."""
        if self.policy is not None and self.policy.strict:
            raise error(
                f"optimize: {why}; the fused ops ({', '.join(_TRITON_PATTERNS)}) cannot run "
                "(strict mode, so nothing is left as written silently)"
            )
        self.skip(
            "<model>",
            f"{why}: {', '.join(_TRITON_PATTERNS)} left as written; the norms run PyTorch's "
            "kernels",
        )
        named = self._named
        return lambda op: "torch" if op in _TRITON_PATTERNS else named(op)


def _other_float_dtypes(model: nn.Module) -> str | None:
    """The model's floating-point parameter dtypes where none is one the fused ops take
    (fp32, fp16, bf16), as text; None otherwise (or without floating parameters)."""
    dtypes = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    if not dtypes or dtypes & {torch.float32, torch.float16, torch.bfloat16}:
        return None
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _refuse_sharded(path: str, module: nn.Module) -> None:
    """FSDP2 swaps unsharded parameters into the modules it was given at each forward:
    a module put in their place afterwards would compute with the shards."""
    if any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False)):
        raise UnsupportedOperationError(
            f"{path}: its parameters are already sharded by fully_shard (FSDP2), which "
            "swaps parameters into the modules it wrapped; apply the policy first "
            "(xpt.optimize(model, policy)), then fully_shard, then build the optimizer"
        )

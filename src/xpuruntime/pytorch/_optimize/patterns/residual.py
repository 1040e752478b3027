"""A residual add and the norm after it (``h = residual + h; residual = h; h =
self.<norm>(h)``, Llama's decoder layer and ~250 modeling files; GPT-2's ``h =
attn_output + residual``) as one op: ``residual_rmsnorm`` with an RMSNorm,
``residual_layernorm`` with a LayerNorm (:func:`ops.fused_add_rmsnorm` /
:func:`ops.fused_add_layernorm` where it picks ``fused``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import nn as routed
from ..._functional._residual import residual_norm
from .._report import Finding
from .._run import Run

FUSED = Finding(
    "fused_residuals",
    "residual add(s)",
    "{}: runs with the residual add before it (fused where the add's operands have one shape)",
    triton=True,
    doc="the norms whose input residual add now runs fused with them (``residual_rmsnorm`` or ``residual_layernorm``)",
)
_OPS = ("residual_rmsnorm", "residual_layernorm")


class Residual:
    kind = "residual"  # the statement engine's kind
    helper = staticmethod(residual_norm)
    findings = (FUSED,)

    def takes(self, run: Run, module: nn.Module) -> bool:
        return any(run.fuses(op) for op in _OPS)

    def accept(self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]):
        """The norms of the rewritten statements that the op runs with their add."""
        ops = {op for op in _OPS if run.fuses(op)}
        return [f"{path}.{norm}" for (norm,) in found if _op(getattr(module, norm), run) in ops]


def _op(module: nn.Module, run: Run) -> str | None:
    """The op that runs a residual add with ``module`` after it: ``residual_rmsnorm``
    where ``module`` is (or will be replaced by) our RMSNorm, ``residual_layernorm`` for
    our LayerNorm, else None."""
    if isinstance(module, routed.RMSNorm):
        return "residual_rmsnorm"
    if isinstance(module, routed.LayerNorm):
        return "residual_layernorm"
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        if own_forward(module):
            return None
        return "residual_rmsnorm" if isinstance(module, nn.RMSNorm) else "residual_layernorm"
    match: Any = run.norm_match(module)
    return "residual_rmsnorm" if match is not None and match[0] is not None else None


def own_forward(module: nn.Module) -> bool:
    """Whether a LayerNorm or RMSNorm subclass computes something else in its forward."""
    return type(module).forward not in (nn.LayerNorm.forward, nn.RMSNorm.forward)


PATTERN = Residual()

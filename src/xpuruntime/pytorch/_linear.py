"""linear routed by the policy's ``linear`` op: what :class:`ops.FusedLinear` calls.

Each call signature is resolved once through the dispatcher (``fused``:
:func:`ops.fused_linear`; ``torch``: ``F.linear``; ``auto``: the first that runs, or the
faster one measured under ``best_performance``) and cached until the policy changes.
Under ``torch.compile`` nothing is measured inside the trace: the policy's named kernel
runs, and ``auto`` means ``fused`` where Triton runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autocast import autocast_dtype
from ._context import LinearContext
from ._kernels import LINEAR_ORDER
from ._policy import _per_call, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["linear"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` or :func:`ops.fused_linear`, as the policy decides."""
    from .ops.fused_linear import fused_linear

    if _choose(input, weight, bias) == "fused":
        return fused_linear(input, weight, bias)
    return F.linear(input, weight, bias)


def _choose(input, weight, bias) -> str:
    if torch.compiler.is_compiling():
        return traced_choice("linear", input.device)
    compute = autocast_dtype(input.device.type) or input.dtype
    signature = (
        input.shape,
        input.dtype,
        input.device,
        weight.shape,
        weight.dtype,
        bias is None,
        compute,
        _grad_enabled(),
        _deterministic(),
    )
    decision = _per_call["linear"].get(signature)
    if decision is None:
        ctx = LinearContext(
            input, weight.shape[0], compute, weight.dtype, bias is not None, _deterministic()
        )
        decision = resolve_per_call(
            "linear", signature, ctx, LINEAR_ORDER, lambda kernel: _time_linear(kernel.name, ctx)
        )
    return decision.chosen


def _time_linear(name: str, ctx: LinearContext) -> float:
    from .ops.fused_linear import fused_linear

    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    shape = (ctx.out_features, ctx.input.shape[-1])
    weight = torch.randn(shape, device=x.device, dtype=ctx.param_dtype) / shape[1] ** 0.5
    weight.requires_grad_(ctx.requires_grad)
    bias = None
    if ctx.has_bias:
        bias = torch.zeros(shape[0], device=x.device, dtype=ctx.param_dtype)
        bias.requires_grad_(ctx.requires_grad)
    linear = fused_linear if name == "fused" else F.linear
    autocast = ctx.compute_dtype != ctx.input.dtype or ctx.compute_dtype != ctx.param_dtype

    def run() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=ctx.compute_dtype, enabled=autocast):
            return linear(x, weight, bias)

    leaves = [t for t in (x, weight, bias) if t is not None]
    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)

"""layer_norm and rms_norm routed by the policy's ``layernorm`` / ``rmsnorm`` op.

What :class:`ops.FusedLayerNorm` and :class:`ops.FusedRMSNorm` call. Each call
signature is resolved once through the dispatcher (``fused``: our Triton kernels;
``torch``: PyTorch's; ``auto``: the first that runs, or the faster one measured under
``best_performance``) and cached until the policy changes. Under ``torch.compile`` nothing
is measured inside the trace: the policy's named kernel runs, and ``auto`` means
``fused`` where Triton runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autocast import autocast_dtype
from ._context import NormContext
from ._kernels import NORM_ORDER
from ._policy import _per_call, current_state, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["layer_norm", "rms_norm"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled


def layer_norm(input, normalized_shape, weight, bias, eps: float) -> torch.Tensor:
    """``F.layer_norm`` or :func:`ops.fused_layernorm`, as the policy decides."""
    from .ops.fused_layernorm import fused_layernorm

    out_dtype = _emitted_dtype(input)
    if _choose("layernorm", input, normalized_shape, weight, bias) == "fused":
        return fused_layernorm(input, normalized_shape, weight, bias, eps, out_dtype=out_dtype)
    y = F.layer_norm(input, normalized_shape, weight, bias, eps)
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm(input, normalized_shape, weight, eps: float | None) -> torch.Tensor:
    """PyTorch's RMSNorm or :func:`ops.fused_rmsnorm`, as the policy decides."""
    from .ops.fused_rmsnorm import fused_rmsnorm, torch_rms_norm

    out_dtype = _emitted_dtype(input)
    if _choose("rmsnorm", input, normalized_shape, weight, None) == "fused":
        return fused_rmsnorm(input, normalized_shape, weight, eps, out_dtype=out_dtype)
    y = torch_rms_norm(input, normalized_shape, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def _emitted_dtype(input: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when the policy's ``autocast_norms`` is on and autocast is on
    for ``input``'s device; otherwise None (each kernel's own output dtype)."""
    policy = current_state().policy
    if policy is None or not policy.autocast_norms:
        return None
    return autocast_dtype(input.device.type)


def _choose(op: str, input, normalized_shape, weight, bias) -> str:
    if torch.compiler.is_compiling():
        return traced_choice(op, input.device)
    signature = (
        input.shape,
        input.dtype,
        input.device,
        tuple(normalized_shape),
        weight is None,
        bias is None,
        _grad_enabled() and input.requires_grad,
        _deterministic(),
    )
    decision = _per_call[op].get(signature)
    if decision is None:
        ctx = NormContext(
            input, tuple(normalized_shape), weight is not None, bias is not None, _deterministic()
        )
        decision = resolve_per_call(
            op, signature, ctx, NORM_ORDER, lambda kernel: _time_norm(op, kernel.name, ctx)
        )
    return decision.chosen


def _time_norm(op: str, name: str, ctx: NormContext) -> float:
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    shape = ctx.normalized_shape
    weight = _parameter(shape, x, ctx) if ctx.has_weight else None
    bias = _parameter(shape, x, ctx) if ctx.has_bias else None
    grad = torch.randn_like(x) if ctx.requires_grad else None
    if op == "layernorm":
        from .ops.fused_layernorm import fused_layernorm as fused

        def run():
            if name == "fused":
                return fused(x, shape, weight, bias, 1e-5)
            return F.layer_norm(x, shape, weight, bias, 1e-5)
    else:
        from .ops.fused_rmsnorm import fused_rmsnorm, torch_rms_norm

        def run():
            if name == "fused":
                return fused_rmsnorm(x, shape, weight, 1e-6)
            return torch_rms_norm(x, shape, weight, 1e-6)

    leaves = [t for t in (x, weight, bias) if t is not None]
    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad, grad=grad)


def _parameter(shape: tuple[int, ...], x: torch.Tensor, ctx: NormContext) -> torch.Tensor:
    p = torch.randn(shape, device=x.device, dtype=x.dtype)
    return p.requires_grad_(ctx.requires_grad)

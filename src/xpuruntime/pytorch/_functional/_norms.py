"""layer_norm and rms_norm routed by the policy's ``layernorm`` / ``rmsnorm`` op.

What :class:`nn.LayerNorm` and :class:`nn.RMSNorm` call: :class:`RoutedOp`
declarations (``fused``: our Triton kernels; ``torch``: PyTorch's; ``auto``: the first
that runs, or the faster one measured under ``best_performance``).
"""

from __future__ import annotations

import torch

from .._kernels._context import NormContext
from .._ops._infra._launch import autocast_dtype
from .._selection._policy import current_state, torch_under_compile
from .._selection._routed import RoutedOp

__all__ = ["layer_norm", "rms_norm"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms  # what torch.are_... returns


def layer_norm(input, normalized_shape, weight, bias, eps: float) -> torch.Tensor:
    """``F.layer_norm`` or :func:`ops.fused_layernorm`, as the policy decides."""
    return _layer_norm(input, normalized_shape, weight, bias, eps, _emitted_dtype(input))


def rms_norm(input, normalized_shape, weight, eps: float | None) -> torch.Tensor:
    """PyTorch's RMSNorm or :func:`ops.fused_rmsnorm`, as the policy decides."""
    return _rms_norm(input, normalized_shape, weight, eps, _emitted_dtype(input))


def _emitted_dtype(input: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when the policy's ``autocast_norms`` is on and autocast is on
    for ``input``'s device; otherwise None (each kernel's own output dtype)."""
    policy = current_state().policy
    if policy is None or not policy.autocast_norms:
        return None
    return autocast_dtype(input.device.type)


def _signature(input, normalized_shape, weight, bias=None, *_) -> tuple:
    return (
        input.shape,
        input.dtype,
        input.device,
        tuple(normalized_shape),
        weight is None,
        bias is None,
        _grad_enabled() and input.requires_grad,
        _deterministic(),
    )


def _layer_norm_context(input, normalized_shape, weight, bias, eps, out_dtype) -> NormContext:
    shape = tuple(normalized_shape)
    return NormContext(input, shape, weight is not None, bias is not None, _deterministic())


def _rms_norm_context(input, normalized_shape, weight, eps, out_dtype) -> NormContext:
    return NormContext(input, tuple(normalized_shape), weight is not None, False, _deterministic())


def _sample(ctx: NormContext, with_bias: bool) -> tuple[tuple, list[torch.Tensor]]:
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    shape = ctx.normalized_shape

    def parameter() -> torch.Tensor:
        p = torch.randn(shape, device=x.device, dtype=x.dtype)
        return p.requires_grad_(ctx.requires_grad)

    weight = parameter() if ctx.has_weight else None
    bias = parameter() if ctx.has_bias else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    if with_bias:
        return (x, shape, weight, bias, 1e-5, None), leaves
    return (x, shape, weight, 1e-6, None), leaves


_layer_norm = RoutedOp(
    "layernorm",
    signature=_signature,
    context=_layer_norm_context,
    sample=lambda ctx, *call: _sample(ctx, with_bias=True),
)
_rms_norm = RoutedOp(
    "rmsnorm",
    signature=lambda input, shape, weight, *_: _signature(input, shape, weight),
    context=_rms_norm_context,
    sample=lambda ctx, *call: _sample(ctx, with_bias=False),
    traced_auto=torch_under_compile,
)

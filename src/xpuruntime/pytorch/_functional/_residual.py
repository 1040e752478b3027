"""The policy's ``residual_layernorm`` and ``residual_rmsnorm`` ops: a residual add and
the norm of its sum.

A pre-norm transformer adds each block's output to the residual stream and normalises the
sum for the next block (``x = x + attn(ln_1(x)); h = ln_2(x)``); the add and the norm are
separate modules' work, so only a rewrite of the model's forward can fuse them
(:mod:`._rewrite` for forwards fx traces, which has each such pair call
:func:`residual_layer_norm`; :mod:`.._optimize._statements` for transformers'
decoder layers, which call :func:`residual_norm`). Each runs
:func:`ops.fused_add_layernorm` / :func:`ops.fused_add_rmsnorm` or the add and the norm as
before, as the policy decides per call signature (a :class:`RoutedOp`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .._kernels._context import ResidualNormContext
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp
from ._modules import LayerNorm, RMSNorm
from ._norms import _emitted_dtype

__all__ = ["residual_layer_norm", "residual_norm"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms


def residual_layer_norm(
    input: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input + branch, norm(input + branch))``, in one fused kernel or as the add and
    the norm module, as the policy's ``residual_layernorm`` op decides."""
    return _through(_routed, input, branch, norm)


def residual_norm(
    input: torch.Tensor, branch: torch.Tensor, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input + branch, norm(input + branch))`` for whatever ``norm`` is: our RMSNorm
    or LayerNorm through the policy's ``residual_rmsnorm`` / ``residual_layernorm`` op;
    any other module as the add and its call."""
    if type(norm) is RMSNorm:
        return _through(_routed_rms, input, branch, norm)
    if type(norm) is LayerNorm:
        return _through(_routed, input, branch, norm)
    h = input + branch
    return h, norm(h)


def _through(op: RoutedOp, input, branch, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The add and the norm through the routed ``op`` where the two are tensors of one
    shape (no broadcasting), else as written."""
    if (
        isinstance(input, torch.Tensor) and isinstance(branch, torch.Tensor)
        and input.shape == branch.shape
    ):  # fmt: skip
        return op(input, branch, norm, _emitted_dtype(input))
    h = input + branch
    return h, norm(h)


def _signature(input, branch, norm, out_dtype) -> tuple:
    grad = _grad_enabled() and (input.requires_grad or branch.requires_grad)
    return (
        input.shape, input.dtype, branch.shape, branch.dtype, input.device,
        norm.normalized_shape, norm.weight is None, norm.bias is None, grad, _deterministic(),
    )  # fmt: skip


def _context(input, branch, norm, out_dtype) -> ResidualNormContext:
    return ResidualNormContext(
        input, tuple(norm.normalized_shape), norm.weight is not None,
        norm.bias is not None, _deterministic(), branch,
    )  # fmt: skip


def _sample(ctx: ResidualNormContext, input, branch, norm, out_dtype) -> tuple[tuple, list]:
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    y = torch.randn_like(ctx.branch).requires_grad_(ctx.requires_grad)
    twin = copy.deepcopy(norm)  # the timed backward must not touch the model's gradients
    return (x, y, twin, out_dtype), [x, y, *twin.parameters()]


def _rms_signature(input, branch, norm, out_dtype) -> tuple:
    grad = _grad_enabled() and (input.requires_grad or branch.requires_grad)
    return (
        input.shape, input.dtype, branch.shape, branch.dtype, input.device,
        norm.normalized_shape, norm.weight is None, norm.weight_offset, grad, _deterministic(),
    )  # fmt: skip


def _rms_context(input, branch, norm, out_dtype) -> ResidualNormContext:
    return ResidualNormContext(
        input, tuple(norm.normalized_shape), norm.weight is not None, False, _deterministic(),
        branch,
    )  # fmt: skip


_routed = RoutedOp("residual_layernorm", signature=_signature, context=_context, sample=_sample)
_routed_rms = RoutedOp(
    "residual_rmsnorm",
    signature=_rms_signature,
    context=_rms_context,
    sample=_sample,
    traced_auto=torch_under_compile,
)

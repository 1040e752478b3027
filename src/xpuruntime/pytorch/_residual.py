"""The policy's ``residual_layernorm`` op: a residual add and the layer norm of its sum.

A pre-norm transformer adds each block's output to the residual stream and normalises the
sum for the next block (``x = x + attn(ln_1(x)); h = ln_2(x)``); the add and the norm are
separate modules' work, so only a rewrite of the model's forward can fuse them
(:mod:`._rewrite`, which has each such pair call :func:`residual_layer_norm`). It runs
:func:`ops.fused_add_layernorm` or the add and the norm as before, as the policy decides
per call signature.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ._context import ResidualNormContext
from ._kernels import NORM_ORDER
from ._norms import _emitted_dtype
from ._policy import _per_call, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["residual_layer_norm"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled


def residual_layer_norm(
    input: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input + branch, norm(input + branch))``, in one fused kernel or as the add and
    the norm module, as the policy's ``residual_layernorm`` op decides."""
    if (
        isinstance(input, torch.Tensor) and isinstance(branch, torch.Tensor)
        and input.shape == branch.shape and _choose(input, branch, norm) == "fused"
    ):  # fmt: skip
        from .ops.fused_add_layernorm import fused_add_layernorm

        return fused_add_layernorm(
            input, branch, norm.normalized_shape, norm.weight, norm.bias, norm.eps,
            out_dtype=_emitted_dtype(input),
        )  # fmt: skip
    h = input + branch
    return h, norm(h)


def _choose(input: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm) -> str:
    if torch.compiler.is_compiling():
        return traced_choice("residual_layernorm", input.device)
    grad = _grad_enabled() and (input.requires_grad or branch.requires_grad)
    signature = (
        input.shape, input.dtype, branch.shape, branch.dtype, input.device,
        norm.normalized_shape, norm.weight is None, norm.bias is None, grad, _deterministic(),
    )  # fmt: skip
    decision = _per_call["residual_layernorm"].get(signature)
    if decision is None:
        ctx = ResidualNormContext(
            input, tuple(norm.normalized_shape), norm.weight is not None,
            norm.bias is not None, _deterministic(), branch,
        )  # fmt: skip
        decision = resolve_per_call(
            "residual_layernorm", signature, ctx, NORM_ORDER,
            lambda kernel: _time(kernel.name, ctx, norm),
        )  # fmt: skip
    return decision.chosen


def _time(name: str, ctx: ResidualNormContext, norm: nn.LayerNorm) -> float:
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    y = torch.randn_like(ctx.branch).requires_grad_(ctx.requires_grad)
    twin = copy.deepcopy(norm)  # the timed backward must not touch the model's gradients
    leaves = [x, y, *twin.parameters()]

    def run():
        if name == "fused":
            from .ops.fused_add_layernorm import fused_add_layernorm

            return fused_add_layernorm(
                x, y, twin.normalized_shape, twin.weight, twin.bias, twin.eps,
                out_dtype=_emitted_dtype(x),
            )[1]  # fmt: skip
        return twin(x + y)

    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)

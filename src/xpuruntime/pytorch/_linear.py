"""linear routed by the policy's ``linear`` op (what :class:`ops.FusedLinear` calls), and
a linear layer followed by GELU routed by its ``linear_gelu`` op (what the forwards that
:func:`optimize` rewrites call).

Each call signature is resolved once through the dispatcher (``fused``:
:func:`ops.fused_linear` / :func:`ops.fused_linear_gelu`; ``cublaslt`` (linear_gelu):
:func:`ops.fused_linear_gelu` with its cuBLASLt-epilogue forward; ``torch``: ``F.linear``
/ the layer then ``F.gelu``; ``auto``: the first that runs, or the fastest measured under
``best_performance``) and cached until the policy changes.
Under ``torch.compile`` nothing is measured inside the trace: the policy's named kernel
runs, and ``auto`` means ``fused`` where Triton runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._autocast import autocast_dtype
from ._context import LinearContext
from ._kernels import LINEAR_GELU_ORDER, LINEAR_ORDER
from ._policy import _per_call, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["linear", "linear_gelu"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` or :func:`ops.fused_linear`, as the policy decides."""
    from .ops.fused_linear import fused_linear

    if _choose("linear", input, weight, bias) == "fused":
        return fused_linear(input, weight, bias)
    return F.linear(input, weight, bias)


def linear_gelu(input: torch.Tensor, layer: nn.Linear, approximate: str) -> torch.Tensor:
    """``F.gelu(layer(input), approximate=approximate)``: :func:`ops.fused_linear_gelu`
    or the layer then ``F.gelu``, as the policy's ``linear_gelu`` op decides."""
    from .ops.fused_linear import fused_linear_gelu

    chosen = _choose("linear_gelu", input, layer.weight, layer.bias, approximate)
    if chosen == "torch":
        return F.gelu(layer(input), approximate=approximate)
    forward = "cublaslt" if chosen == "cublaslt" else "torch"
    return fused_linear_gelu(input, layer.weight, layer.bias, approximate, forward=forward)


def _choose(op, input, weight, bias, approximate=None) -> str:
    if torch.compiler.is_compiling():
        return traced_choice(op, input.device)
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
        approximate,
    )
    decision = _per_call[op].get(signature)
    if decision is None:
        ctx = LinearContext(
            input,
            weight.shape[0],
            compute,
            weight.dtype,
            bias is not None,
            _deterministic(),
            approximate,
        )
        order = LINEAR_ORDER if approximate is None else LINEAR_GELU_ORDER
        decision = resolve_per_call(
            op, signature, ctx, order, lambda kernel: _time(kernel.name, ctx, approximate)
        )
    return decision.chosen


def _time(name: str, ctx: LinearContext, approximate: str | None) -> float:
    """One kernel's training-call time on fresh tensors shaped as ``ctx``; with
    ``approximate``, the linear layer followed by GELU."""
    from .ops.fused_linear import fused_linear, fused_linear_gelu

    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    shape = (ctx.out_features, ctx.input.shape[-1])
    weight = torch.randn(shape, device=x.device, dtype=ctx.param_dtype) / shape[1] ** 0.5
    weight.requires_grad_(ctx.requires_grad)
    bias = None
    if ctx.has_bias:
        bias = torch.zeros(shape[0], device=x.device, dtype=ctx.param_dtype)
        bias.requires_grad_(ctx.requires_grad)
    autocast = ctx.compute_dtype != ctx.input.dtype or ctx.compute_dtype != ctx.param_dtype

    def run() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=ctx.compute_dtype, enabled=autocast):
            if approximate is None:
                return (fused_linear if name == "fused" else F.linear)(x, weight, bias)
            if name == "torch":
                return F.gelu(F.linear(x, weight, bias), approximate=approximate)
            forward = "cublaslt" if name == "cublaslt" else "torch"
            return fused_linear_gelu(x, weight, bias, approximate, forward=forward)

    leaves = [t for t in (x, weight, bias) if t is not None]
    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)

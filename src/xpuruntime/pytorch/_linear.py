"""linear routed by the policy's ``linear`` op (what :class:`ops.FusedLinear` calls), a
linear layer followed by GELU routed by its ``linear_gelu`` op, and a linear layer, GELU
and a linear layer routed by its ``mlp`` op (what the forwards that :func:`optimize`
rewrites call).

Each call signature is resolved once through the dispatcher (``fused``:
:func:`ops.fused_linear` / :func:`ops.fused_linear_gelu`; ``cublaslt`` (linear_gelu):
:func:`ops.fused_linear_gelu` with its cuBLASLt-epilogue forward; ``torch``: ``F.linear``
/ the layer then ``F.gelu``; ``mlp``: ``cublaslt`` (:func:`ops.fused_mlp`) or ``torch``
(the layers as written); ``auto``: the first that runs, or the fastest measured under
``best_performance``) and cached until the policy changes.
Under ``torch.compile`` nothing is measured inside the trace: the policy's named kernel
runs, and ``auto`` means ``fused`` where Triton runs (for ``mlp``, the layers as
written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._autocast import autocast_dtype
from ._context import LinearContext, MLPContext
from ._kernels import LINEAR_GELU_ORDER, LINEAR_ORDER, MLP_ORDER
from ._policy import _per_call, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["linear", "linear_gelu", "mlp"]

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


def mlp(
    input: torch.Tensor, fc: nn.Linear, proj: nn.Linear, approximate: str, gelu_routed: bool
) -> torch.Tensor:
    """``proj(F.gelu(fc(input), approximate=approximate))``: :func:`ops.fused_mlp` or the
    layers as written (``fc`` and its GELU through :func:`linear_gelu` when the policy
    routes that pair, ``gelu_routed``), as the policy's ``mlp`` op decides."""
    from .ops.fused_mlp import fused_mlp

    if _choose("mlp", input, fc.weight, fc.bias, approximate, proj) == "cublaslt":
        return fused_mlp(input, fc.weight, fc.bias, proj.weight, proj.bias, approximate)
    if gelu_routed:
        return proj(linear_gelu(input, fc, approximate))
    return proj(F.gelu(fc(input), approximate=approximate))


def _choose(op, input, weight, bias, approximate=None, proj=None) -> str:
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
        None if proj is None else (proj.weight.shape, proj.bias is None),
    )
    decision = _per_call[op].get(signature)
    if decision is None:
        args = (input, weight.shape[0], compute, weight.dtype, bias is not None)
        args += (_deterministic(), approximate)
        if proj is None:
            ctx = LinearContext(*args)
            order = LINEAR_ORDER if approximate is None else LINEAR_GELU_ORDER
        else:
            ctx, order = MLPContext(*args, proj.weight.shape[0]), MLP_ORDER
        decision = resolve_per_call(
            op, signature, ctx, order, lambda kernel: _time(kernel.name, ctx)
        )
    return decision.chosen


def _time(name: str, ctx: LinearContext) -> float:
    """One kernel's training-call time on fresh tensors shaped as ``ctx``: the linear
    layer, followed by GELU where ``ctx.approximate`` says, and by the second layer of an
    :class:`MLPContext`."""
    from .ops.fused_linear import fused_linear, fused_linear_gelu
    from .ops.fused_mlp import fused_mlp

    def parameters(out_features: int, in_features: int) -> list[torch.Tensor]:
        weight = torch.randn(out_features, in_features, device=x.device, dtype=ctx.param_dtype)
        made = [weight / in_features**0.5]
        if ctx.has_bias:
            made.append(torch.zeros(out_features, device=x.device, dtype=ctx.param_dtype))
        return [t.requires_grad_(ctx.requires_grad) for t in made]

    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    first = parameters(ctx.out_features, ctx.input.shape[-1])
    weight, bias = first[0], first[1] if ctx.has_bias else None
    second = []
    if isinstance(ctx, MLPContext):
        second = parameters(ctx.proj_out_features, ctx.out_features)
        proj_weight, proj_bias = second[0], second[1] if ctx.has_bias else None
    autocast = ctx.compute_dtype != ctx.input.dtype or ctx.compute_dtype != ctx.param_dtype
    approximate = ctx.approximate

    def run() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=ctx.compute_dtype, enabled=autocast):
            if second:
                if name == "cublaslt":
                    return fused_mlp(x, weight, bias, proj_weight, proj_bias, approximate)
                hidden = F.gelu(F.linear(x, weight, bias), approximate=approximate)
                return F.linear(hidden, proj_weight, proj_bias)
            if approximate is None:
                return (fused_linear if name == "fused" else F.linear)(x, weight, bias)
            if name == "torch":
                return F.gelu(F.linear(x, weight, bias), approximate=approximate)
            forward = "cublaslt" if name == "cublaslt" else "torch"
            return fused_linear_gelu(x, weight, bias, approximate, forward=forward)

    leaves = [t for t in (x, *first, *second) if t is not None]
    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)

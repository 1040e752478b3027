"""linear routed by the policy's ``linear`` op (what :class:`nn.Linear` calls), a
linear layer followed by GELU routed by its ``linear_gelu`` op, and a linear layer, GELU
and a linear layer routed by its ``mlp`` op (what the forwards that :func:`optimize`
rewrites call): :class:`RoutedOp` declarations. :func:`linear_act` is what the forwards
:func:`optimize` binds on modules we did not write call for a linear layer (or
transformers' ``Conv1D``, its weight transposed) and a GELU module (transformers'
``NewGELUActivation`` and the like, recognised by probe): the ``linear_gelu`` op.

Kernels: ``fused`` (:func:`ops.fused_linear` / :func:`ops.fused_linear_gelu`),
``cublaslt`` (linear_gelu: :func:`ops.fused_linear_gelu` with its cuBLASLt-epilogue
forward; mlp: :func:`ops.fused_mlp`), ``torch`` (``F.linear`` / the layer then ``F.gelu``
/ the layers as written); ``auto``: the first that runs, or the fastest measured under
``best_performance``. Under ``torch.compile`` ``auto`` means ``fused`` where Triton runs
(for ``mlp``, the layers as written).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._kernels._context import LinearContext, MLPContext
from .._ops._infra._launch import autocast_dtype
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp

__all__ = ["linear", "linear_act", "linear_gelu", "mlp", "register_linear_act", "timing_autocast"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` or :func:`ops.fused_linear`, as the policy decides."""
    return _linear(input, weight, bias)


def linear_gelu(input: torch.Tensor, layer: nn.Linear, approximate: str) -> torch.Tensor:
    """``F.gelu(layer(input), approximate=approximate)``: :func:`ops.fused_linear_gelu`
    or the layer then ``F.gelu``, as the policy's ``linear_gelu`` op decides."""
    return _linear_gelu(input, layer, approximate)


# What optimize() found each bound linear layer and activation to compute (by probe),
# held on the modules themselves: "linear" or "transposed" (a Conv1D: x @ weight + bias);
# "tanh" or "none" (GELU's form). Not a weak table: torch.compile guards on what a traced
# forward reads, and a table's entries vanish with other models' modules.
_KIND = "_xpuruntime_linear_kind"
_FORM = "_xpuruntime_gelu_form"


def register_linear_act(
    layer: nn.Module, kind: str, act: nn.Module, form: str
) -> Callable[[], None]:
    """Let :func:`linear_act` run ``act(layer(x))`` as the ``linear_gelu`` op: ``layer``
    computes a linear layer of ``kind`` and ``act`` GELU's ``form`` (both probed).
    Returns what undoes it."""
    setattr(layer, _KIND, kind)
    setattr(act, _FORM, form)

    def undo() -> None:
        layer.__dict__.pop(_KIND, None)
        act.__dict__.pop(_FORM, None)

    return undo


def linear_act(input: torch.Tensor, layer: nn.Module, act: nn.Module) -> torch.Tensor:
    """``act(layer(input))``: through the policy's ``linear_gelu`` op where ``layer`` and
    ``act`` were registered (:func:`register_linear_act`), else as written (what the
    forwards :func:`optimize` binds call in place of the two statements)."""
    kind, form = layer.__dict__.get(_KIND), act.__dict__.get(_FORM)
    if kind is None or form is None or not isinstance(input, torch.Tensor):
        return act(layer(input))
    return _linear_gelu(input, layer if kind == "linear" else _AsLinear(layer), form)


class _AsLinear:
    """A layer computing ``x @ weight + bias`` (weight (in, out), transformers' Conv1D)
    seen as a linear layer: ``weight`` (out, in) is a view of the layer's own, so its
    gradient reaches the layer's parameter."""

    __slots__ = ("layer",)

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight.t()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.layer.bias

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return self.layer(input)


def mlp(
    input: torch.Tensor, fc: nn.Linear, proj: nn.Linear, approximate: str, gelu_routed: bool
) -> torch.Tensor:
    """``proj(F.gelu(fc(input), approximate=approximate))``: :func:`ops.fused_mlp` or the
    layers as written (``fc`` and its GELU through :func:`linear_gelu` when the policy
    routes that pair, ``gelu_routed``), as the policy's ``mlp`` op decides."""
    if gelu_routed:
        first = lambda x: _linear_gelu(x, fc, approximate)  # noqa: E731
    else:
        first = lambda x: F.gelu(fc(x), approximate=approximate)  # noqa: E731
    return _mlp(input, fc, proj, approximate, first)


def _signature(input, weight, bias, approximate=None, proj=None) -> tuple:
    return (
        input.shape,
        input.dtype,
        input.device,
        weight.shape,
        weight.dtype,
        bias is None,
        autocast_dtype(input.device.type) or input.dtype,
        _grad_enabled(),
        _deterministic(),
        approximate,
        None if proj is None else (proj.weight.shape, proj.bias is None),
    )


def _context(input, weight, bias, approximate=None, proj=None) -> LinearContext:
    compute = autocast_dtype(input.device.type) or input.dtype
    args = (input, weight.shape[0], compute, weight.dtype, bias is not None)
    args += (_deterministic(), approximate)
    return LinearContext(*args) if proj is None else MLPContext(*args, proj.weight.shape[0])


def _sample(ctx: LinearContext, *call) -> tuple[tuple, list[torch.Tensor]]:
    """Fresh arguments shaped as ``ctx`` (layers for linear_gelu and mlp)."""
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)

    def layer(out_features: int, in_features: int) -> nn.Linear:
        made = nn.Linear(in_features, out_features, bias=ctx.has_bias, device=x.device)
        made = made.to(ctx.param_dtype).requires_grad_(ctx.requires_grad)
        with torch.no_grad():
            made.weight.normal_(0, in_features**-0.5)
        return made

    first = layer(ctx.out_features, ctx.input.shape[-1])
    leaves = [x, *first.parameters()]
    if isinstance(ctx, MLPContext):
        second = layer(ctx.proj_out_features, ctx.out_features)
        leaves += list(second.parameters())
        args = (
            x,
            first,
            second,
            ctx.approximate,
            lambda h: F.gelu(first(h), approximate=ctx.approximate),
        )
    elif ctx.approximate is not None:
        args = (x, first, ctx.approximate)
    else:
        args = (x, first.weight, first.bias)
    return args, leaves


def timing_autocast(ctx: LinearContext):
    """Timing runs under the call's autocast dtype, where it differs from its tensors'."""
    wanted = ctx.compute_dtype != ctx.input.dtype or ctx.compute_dtype != ctx.param_dtype
    return torch.autocast(ctx.device.type, dtype=ctx.compute_dtype, enabled=wanted)


_linear = RoutedOp(
    "linear", signature=_signature, context=_context, sample=_sample, around=timing_autocast
)
_linear_gelu = RoutedOp(
    "linear_gelu",
    signature=lambda input, layer, approximate: _signature(
        input, layer.weight, layer.bias, approximate
    ),
    context=lambda input, layer, approximate: _context(
        input, layer.weight, layer.bias, approximate
    ),
    sample=_sample,
    around=timing_autocast,
)
_mlp = RoutedOp(
    "mlp",
    signature=lambda input, fc, proj, approximate, first: _signature(
        input, fc.weight, fc.bias, approximate, proj
    ),
    context=lambda input, fc, proj, approximate, first: _context(
        input, fc.weight, fc.bias, approximate, proj
    ),
    sample=_sample,
    around=timing_autocast,
    traced_auto=torch_under_compile,
)

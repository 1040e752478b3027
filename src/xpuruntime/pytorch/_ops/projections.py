"""Linear layers of one input as one GEMM (the ``projections`` op's kernels): each layer
as written, or the weights joined (cast and concatenated in one copy) and one GEMM each
way; the results are views of the joined output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._infra._first_order import first_order
from ._infra._frozen_casts import frozen_cast
from ._infra._grad_targets import gradient_target, targeted
from ._infra._joined_storage import join_weights
from ._infra._launch import autocast_dtype, mm_as

__all__ = ["run_joined", "run_joined_fp8", "run_separately"]


def run_separately(
    input: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Each layer as written: ``F.linear`` once per weight."""
    if not biases:
        return tuple(F.linear(input, w) for w in weights)
    return tuple(F.linear(input, w, b) for w, b in zip(weights, biases))


def run_joined(
    input: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """One GEMM over the joined weights; the results are views of its output."""
    compute = autocast_dtype(input.device.type) or input.dtype
    cast = frozen_cast(weights, compute, join_weights)  # a frozen base's kept cast, or None
    joined = _Joined.apply(input, compute, cast, len(weights), *weights, *biases)
    return joined.split([w.shape[0] for w in weights], dim=-1)


def run_joined_fp8(
    input: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor, ...],
    recipe: str,
) -> tuple[torch.Tensor, ...]:
    """One GEMM over the joined weights each way, with FP8 operands
    (:func:`.fp8.fp8_linear_joined`, ``recipe`` ``'tensorwise'`` or ``'rowwise'``); the
    results are views of its output. Each weight's gradient is its rows of the joined
    one's; the backward keeps the weights, not their join (FSDP2 frees gathered ones)."""
    from .fp8 import fp8_linear_joined

    compute = autocast_dtype(input.device.type) or input.dtype
    with torch.autocast(input.device.type, enabled=False):
        joined = fp8_linear_joined(input.to(compute), weights, recipe)
        if biases:
            joined = joined + torch.cat([b.to(compute) for b in biases])
    return joined.split([w.shape[0] for w in weights], dim=-1)


class _Joined(torch.autograd.Function):
    """``F.linear(input, cat(weights), cat(biases))`` in ``compute``'s dtype; the
    parameters' gradients split back, each in its parameter's dtype."""

    @staticmethod
    def forward(ctx, input, compute, cast, count, *params):
        weights, biases = params[:count], params[count:]
        weight = join_weights(weights, compute) if cast is None else cast
        bias = join_weights(biases, compute) if biases else None
        x = input.to(compute)
        with torch.autocast(input.device.type, enabled=False):
            out = F.linear(x, weight, bias)
        # The joined copy is kept where it is a cast, as each layer as written would keep
        # its cast weight; weights already in the compute dtype (bf16 parameters, FSDP2's
        # gathered ones) are joined again in the backward: F.linear keeps no copy of them.
        casts = any(w.dtype != compute for w in weights)
        ctx.save_for_backward(x, weight if casts else None, *(() if casts else weights))
        ctx.layout = (input.dtype, [w.shape[0] for w in weights], [p.dtype for p in params])
        ctx.targeted = [targeted(w) for w in weights]  # where their gradients go, if anywhere
        return out

    @staticmethod
    @first_order("projections")
    def backward(ctx, grad):
        x, weight, *weights = ctx.saved_tensors
        if weight is None:
            weight = join_weights(tuple(weights), x.dtype)
        input_dtype, sizes, dtypes = ctx.layout
        count = len(sizes)
        needs = ctx.needs_input_grad
        grad = grad.to(weight.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_input = None
        if needs[0]:
            grad_input = (grad @ weight).to(input_dtype)
        grads: list[torch.Tensor | None] = [None] * len(dtypes)
        if any(needs[4 : 4 + count]):
            param_dtype = dtypes[0]
            flat_x = x.reshape(-1, x.shape[-1])
            if any(w is not None for w in ctx.targeted):
                grads[:count] = _into_targets(rows, flat_x, ctx.targeted, sizes, dtypes, needs[4:])
            else:
                # Where the GEMM writes fp32 itself, no bf16 product is cast afterwards.
                grads[:count] = mm_as(rows.t(), flat_x, param_dtype).split(sizes)
        if len(dtypes) > count and any(needs[4 + count :]):
            summed = rows.sum(0, dtype=torch.float32)
            grads[count:] = [g.to(dtypes[-1]) for g in summed.split(sizes)]
        return grad_input, None, None, None, *grads


def _into_targets(rows, flat_x, weights, sizes, dtypes, needs) -> list[torch.Tensor | None]:
    """The weights' gradients (those ``needs`` asks for, one flag per weight), one GEMM
    each, each written into its gradient target where it has one
    (:mod:`._infra._grad_targets`): a joined GEMM's result would be copied there."""
    grads: list[torch.Tensor | None] = []
    start = 0
    for weight, size, dtype, needed in zip(weights, sizes, dtypes, needs):
        part = rows[:, start : start + size]
        start += size
        if not needed:
            grads.append(None)
            continue
        out = gradient_target(weight, torch.Size((size, flat_x.shape[1])), dtype)
        grads.append(mm_as(part.t(), flat_x, dtype, out))
    return grads

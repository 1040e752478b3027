"""Gated activations routed by the policy: ``swiglu`` and ``geglu`` (what the MLPs
that :func:`optimize` recognises call). Kernels: ``fused`` (:func:`ops.swiglu`,
:func:`ops.geglu`), ``torch`` (``F.silu(gate) * up``, ``F.gelu(gate, approximate="tanh")
* up``), ``fp8`` (the fused passes keeping gate and up in FP8 for the backward, under
the policy's ``fp8_activations``); ``auto``: the first that runs (under an FP8 precision
the ``fp8`` kernel first), or the fastest measured under ``best_performance``."""

from __future__ import annotations

import torch

from .._kernels._context import ActivationContext
from .._selection._policy import current_state, torch_under_compile
from .._selection._routed import RoutedOp

__all__ = ["geglu", "swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(gate) * up``, by the kernel the policy's ``swiglu`` op picks; ``up``
    None: ``gate`` holds the gate and up as the halves of its last dimension."""
    return _swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up``, by the kernel the policy's ``geglu``
    op picks; ``up`` None: packed, as :func:`swiglu`'s."""
    return _geglu(gate, up)


def _wants_grad(gate: torch.Tensor, up: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (gate.requires_grad or (up is not None and up.requires_grad))


def _signature(gate, up) -> tuple:
    if up is None:
        return (gate.shape, gate.dtype, gate.device, None, _wants_grad(gate, up))
    return (gate.shape, gate.dtype, gate.device, up.shape, up.dtype, up.device,
            _wants_grad(gate, up))  # fmt: skip


def _context(gate: torch.Tensor, up: torch.Tensor | None) -> ActivationContext:
    policy = current_state().policy
    kept = policy is not None and policy.fp8_activations
    return ActivationContext(gate, _wants_grad(gate, up), up is None, kept)


def _checker(op: str):
    def check(gate, up) -> None:
        from .._ops.swiglu import check_swiglu

        check_swiglu(gate, up, op)

    return check


def _sample(ctx: ActivationContext, *call) -> tuple[tuple, list[torch.Tensor]]:
    gate = torch.randn_like(ctx.gate).requires_grad_(ctx.requires_grad)
    if ctx.packed:
        return (gate, None), [gate]
    up = torch.randn_like(ctx.gate).requires_grad_(ctx.requires_grad)
    return (gate, up), [gate, up]


_swiglu, _geglu = (
    RoutedOp(
        op,
        signature=_signature,
        context=_context,
        sample=_sample,
        check=_checker(op),
        traced_auto=torch_under_compile,
    )
    for op in ("swiglu", "geglu")
)

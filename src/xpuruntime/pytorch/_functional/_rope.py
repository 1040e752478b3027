"""Rotary position embedding routed by the policy: ``rope`` (what the attention layers
that :func:`optimize` recognises call in place of their model's
``apply_rotary_pos_emb``). Kernels: ``fused`` (:func:`ops.rope`), ``torch`` (the
elementwise expression); ``auto``: the first that runs, or the fastest measured under
``best_performance``."""

from __future__ import annotations

from typing import Any

import torch

from .._kernels._context import RopeContext
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp

__all__ = ["rope", "takes_call"]


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated by ``cos``/``sin``, by the kernel the policy's ``rope``
    op picks (see :func:`xpuruntime.pytorch.ops.rope`)."""
    return _rope(q, k, cos, sin, interleaved)


def _wants_grad(q: torch.Tensor, k: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def _signature(q, k, cos, sin, interleaved=False) -> tuple:
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
            cos.shape, cos.dtype, sin.shape, sin.dtype, bool(interleaved),
            cos.requires_grad or sin.requires_grad, _wants_grad(q, k))  # fmt: skip


def _check(q, k, cos, sin, interleaved=False) -> None:
    from .._ops.rope import check_rope

    check_rope(q, k, cos, sin, interleaved)


def _sample(
    ctx: RopeContext, q, k, cos, sin, interleaved=False
) -> tuple[tuple, list[torch.Tensor]]:
    q2 = torch.randn_like(q).requires_grad_(ctx.requires_grad)
    k2 = torch.randn_like(k).requires_grad_(ctx.requires_grad)
    return (q2, k2, cos.detach(), sin.detach(), interleaved), [q2, k2]


_rope = RoutedOp(
    "rope",
    signature=_signature,
    context=lambda q, k, cos, sin, interleaved=False: RopeContext(
        q, k, bool(interleaved), _wants_grad(q, k)
    ),
    sample=_sample,
    check=_check,
    traced_auto=torch_under_compile,
)


def takes_call(q: Any, k: Any, cos: Any, sin: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the ``rope`` op takes this call of ``apply_rotary_pos_emb``: q and k as
    (batch, heads, tokens, head_dim), ``unsqueeze_dim=1``, angles (B or 1, tokens,
    head_dim) without gradients."""
    unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
    return not (
        unsqueeze != 1
        or len(args) + len(kwargs) > 1
        or (kwargs and "unsqueeze_dim" not in kwargs)
        or not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin))
        or q.dim() != 4
        or cos.dim() != 3
        or cos.shape[-1] != q.shape[-1]
        or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )

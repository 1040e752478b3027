"""The policy's ``rmsnorm_rope`` op: an attention's per-head q/k norms and its rotary
embedding (Qwen3's ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)``, Gemma3's
alike).

The norms and the rope are separate calls in the modeling file, so only a rewrite of
the attention's forward joins them (:mod:`.._optimize._statements`'s ``head_norms``
kind, which has the rope statement call :func:`head_norms_rope`). It runs
:func:`ops.norm_rope <.._ops.norm_rope.run_rmsnorm_rope>` or PyTorch's expressions, as
the policy decides per call signature (a :class:`RoutedOp`); any call the op does not
take runs as written.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .._kernels._context import RopeContext
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp
from ._modules import RMSNorm
from ._norms import _emitted_dtype
from ._rope import takes_call

__all__ = ["head_norms_rope"]

_grad_enabled = torch.is_grad_enabled


def head_norms_rope(
    rope: Any, q: Any, k: Any, q_norm: nn.Module, k_norm: nn.Module,
    transposed: tuple[bool, bool], cos: Any, sin: Any, *args: Any, **kwargs: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """``rope(q_norm(q), k_norm(k), cos, sin, *args, **kwargs)``, each norm taken
    before its tensor's ``transpose(1, 2)`` where ``transposed`` says the modeling file
    took it there: through the policy's ``rmsnorm_rope`` op where ``rope`` is the
    ``rope`` op's stand-in for the model's ``apply_rotary_pos_emb`` and would take the
    call, and both norms are our RMSNorm over the head width without hooks (which
    commutes with the transpose); else as written."""
    interleaved = getattr(rope, "interleaved", None)
    if (
        interleaved is None
        or not takes_call(q, k, cos, sin, args, kwargs)
        or not _plain_head_norm(q_norm, q)
        or not _plain_head_norm(k_norm, k)
    ):
        q, k = (
            norm(x.transpose(1, 2)).transpose(1, 2) if before else norm(x)
            for x, norm, before in zip((q, k), (q_norm, k_norm), transposed)
        )
        return rope(q, k, cos, sin, *args, **kwargs)
    return _routed(q, k, q_norm, k_norm, cos, sin, interleaved, _emitted_dtype(q))


def _plain_head_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``norm`` is our RMSNorm over ``x``'s last dim, with a weight, called
    without hooks (which the joined op would skip)."""
    return (
        type(norm) is RMSNorm
        and norm.weight is not None
        and tuple(norm.normalized_shape) == (x.shape[-1],)
        and not (norm._forward_hooks or norm._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks
                 or nn.modules.module._global_forward_pre_hooks)
    )  # fmt: skip


def _signature(q, k, q_norm, k_norm, cos, sin, interleaved, out_dtype) -> tuple:
    grad = _grad_enabled() and (
        q.requires_grad or k.requires_grad or q_norm.weight.requires_grad
        or k_norm.weight.requires_grad
    )  # fmt: skip
    return (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), cos.shape, cos.dtype,
        sin.dtype, q_norm.weight.dtype, k_norm.weight.dtype, q_norm.weight_offset,
        k_norm.weight_offset, interleaved, out_dtype, grad,
    )  # fmt: skip


def _context(q, k, q_norm, k_norm, cos, sin, interleaved, out_dtype) -> RopeContext:
    grad = _grad_enabled() and (q.requires_grad or k.requires_grad)
    return RopeContext(q, k, bool(interleaved), grad)


def _sample(ctx: RopeContext, q, k, q_norm, k_norm, cos, sin, interleaved, out_dtype):
    q2 = torch.randn_like(q).requires_grad_(ctx.requires_grad)
    k2 = torch.randn_like(k).requires_grad_(ctx.requires_grad)
    norms = [copy.deepcopy(n) for n in (q_norm, k_norm)]  # (the model's gradients untouched)
    args = (q2, k2, *norms, cos.detach(), sin.detach(), interleaved, out_dtype)
    return args, [q2, k2, *(p for n in norms for p in n.parameters())]


_routed = RoutedOp(
    "rmsnorm_rope",
    signature=_signature,
    context=_context,
    sample=_sample,
    traced_auto=torch_under_compile,
)

r"""fused_attention: scaled dot-product attention with the kernel chosen by policy.

.. math::
    \mathrm{out} = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt{d}} + M\right) V

with :math:`M` the causal or given mask, for ``query`` of shape (batch, heads, seq_q,
head_dim) and ``key``/``value`` of shape (batch, kv_heads, seq_k, head_dim); fewer KV
heads than query heads (grouped-query attention) are shared by consecutive query heads.

Kernels (:mod:`._kernels.attention`, :mod:`._kernels.flash_v4`): PyTorch's SDPA
backends ``flash_v2`` (FlashAttention-2, Dao 2023, arXiv:2307.08691), ``flash_v4``
(FlashAttention-4 in the same backend), ``cudnn``, ``efficient`` (xFormers
memory-efficient attention, Rabe & Staats 2021) and ``math``, and our own ``triton``
kernel (:mod:`._ops.flash_attention`). The op is a :class:`~._routed.RoutedOp`: each call
signature is resolved once through the dispatcher and its kernel's runner cached until
the policy changes, so a call costs a dict lookup and the backend switch on top of
``F.scaled_dot_product_attention``; a policy naming one of PyTorch's backends goes
shorter once a call has resolved to it (the backend alone, PyTorch's selector refusing
what it cannot run; so later signatures the kernel takes are not listed by
``explain_kernel_policy``, while the dispatch log still records every call). Under
torch.compile the choice is made from the policy as the graph is traced.
"""

from __future__ import annotations

import torch

from ..._errors import UnsupportedOperationError
from .._kernels._context import AttentionContext
from .._kernels._switches import SDPA_BACKENDS
from .._kernels.attention import sdpa
from .._ops._infra._attention_inputs import check_attention
from .._selection._policy import current_state
from .._selection._routed import RoutedOp

__all__ = ["fused_attention"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms  # what torch.are_... returns


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim) tensors, by the kernel policy.

    Parameters
    ----------
    query : Tensor (B, H, S_q, D)
    key, value : Tensor (B, H_kv, S_k, D)
        ``H`` must be a multiple of ``H_kv``.
    attn_mask : Tensor, optional
        Boolean (True = attend) or additive float mask, broadcastable to (B, H, S_q, S_k).
    dropout_p : float
        Dropout on the attention weights.
    is_causal : bool
        Causal masking (top-left aligned, as in PyTorch).
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    Tensor (B, H, S_q, D)

    Raises
    ------
    InvalidInputError
        Wrong ranks, mismatched dtypes/devices/shapes, or a bad ``dropout_p``.
    UnsupportedOperationError
        (strict policy) The policy's kernel cannot run this call; lists the reasons.

    Examples
    --------
    >>> from xpuruntime import pytorch as xpt                           # doctest: +SKIP
    >>> with xpt.kernel_policy(attention="flash_v2", strict=True):         # doctest: +SKIP
    ...     out = xpt.ops.fused_attention(q, k, v, is_causal=True)
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)


def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale) -> tuple:
    """What the decision depends on. Key and value's dtype and device are left out to
    keep a hit cheap: PyTorch's backends refuse a mismatch (turned into our error by the
    kernels' runners), and our Triton kernel checks every call."""
    return (
        query.shape,
        key.shape,
        value.shape,
        query.dtype,
        query.device,
        None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.device),
        dropout_p,
        is_causal,
        (query.requires_grad or key.requires_grad or value.requires_grad) and _grad_enabled(),
        _deterministic(),
    )


def _context(query, key, value, attn_mask, dropout_p, is_causal, scale) -> AttentionContext:
    gqa = key.shape[1] != query.shape[1]
    return AttentionContext(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), gqa, _deterministic()
    )


def _sample(ctx: AttentionContext, *call) -> tuple[tuple, list[torch.Tensor]]:
    q, k, v = (torch.randn_like(t).requires_grad_(ctx.requires_grad) for t in call[:3])
    return (q, k, v, ctx.attn_mask, ctx.dropout_p, ctx.is_causal, call[6]), [q, k, v]


def _traced(query, key, value, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor:
    """The call inside a torch.compile trace, where nothing is measured or logged: our
    Triton kernel where the policy names it and it takes the call; a named SDPA kernel
    (then math, unless strict) through F.sdpa in an ``sdpa_kernel`` block, which puts the
    choice into the traced graph (PyTorch's compile caches do not key on the SDPA flags);
    otherwise F.sdpa as PyTorch selects (``auto``). A trace cannot warn, so a non-strict
    policy's fallback from ``triton`` to F.sdpa here is not announced as it is in eager
    mode: ``strict=True`` makes it an error."""
    policy = current_state().policy
    named = None if policy is None else policy.get("attention")
    if named == "triton":
        from .._ops._infra._launch import triton_unavailable
        from .._ops.flash_attention import attention, unsupported

        why = triton_unavailable(query.device) or unsupported(
            query, key, value, attn_mask, dropout_p
        )
        if why is None:
            return attention(query, key, value, is_causal, scale)
        if policy.strict:
            raise UnsupportedOperationError(f"fused_attention: attention='triton': {why}")
    elif named in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        allowed = [named] if policy.strict or named == "math" else [named, "math"]
        with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in allowed]):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)


_attention = RoutedOp(
    "attention",
    signature=_signature,
    context=_context,
    sample=_sample,
    check=lambda q, k, v, mask, p, *_: check_attention(q, k, v, mask, p),
    traced=_traced,
)

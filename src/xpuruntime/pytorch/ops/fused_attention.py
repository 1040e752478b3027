r"""fused_attention: scaled dot-product attention with the kernel chosen by policy.

.. math::
    \mathrm{out} = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt{d}} + M\right) V

with :math:`M` the causal or given mask, for ``query`` of shape (batch, heads, seq_q,
head_dim) and ``key``/``value`` of shape (batch, kv_heads, seq_k, head_dim); fewer KV
heads than query heads (grouped-query attention) are shared by consecutive query heads.

Kernels: PyTorch's SDPA backends ``flash_v2`` (FlashAttention-2, Dao 2023,
arXiv:2307.08691), ``cudnn``, ``efficient`` (xFormers memory-efficient attention, Rabe
& Staats 2021) and ``math``, and our own ``triton`` kernel (:mod:`.flash_attention`).
Each call's signature is resolved once through the dispatcher (the policy's choice, its
fallback or ``auto``; strict mode raises with the reasons) and cached until the policy
changes, so a call costs a dict lookup and the backend switch on top of
``F.scaled_dot_product_attention``. A policy that names one of PyTorch's SDPA kernels
goes shorter once a call has resolved to it: F.sdpa under that backend's flags alone,
PyTorch's selector refusing what the kernel cannot run (with the same checks), and a
refused call resolved as above (so later signatures the kernel takes are not listed by
``explain_kernel_policy``; the dispatch log still records every call). Under
torch.compile the choice is made from the policy as the graph is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._errors import InvalidInputError, UnsupportedOperationError
from .._context import AttentionContext
from .._logging import _in_flight, recording
from .._policy import _attention as _decisions
from .._policy import _attention_plans as _plans
from .._policy import _lock as policy_lock
from .._policy import current_state, resolve_attention
from .._policy import named_attention as _named
from .._ranges import annotate, ranges_active
from .._switches import (
    EXCLUSIVE_SDPA,
    SDPA_BACKENDS,
    only_sdpa_backend,
    read_sdpa_flags,
    write_sdpa_flags,
)

__all__ = ["fused_attention"]


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
    if _compiling():
        return _traced(query, key, value, attn_mask, dropout_p, is_causal, scale)
    named = _named[0]
    refused = False
    if named is not None and not (recording() or ranges_active()):
        # The policy names one of PyTorch's SDPA kernels: F.sdpa with that backend alone
        # enabled runs it, and PyTorch's selector refuses what it cannot run with the very
        # checks the kernel's supports() asks (can_use_flash_attention and the like). A
        # refusal, or a bad input, goes to the per-signature path below, which raises our
        # error or falls back (and warns) as the policy says.
        wanted, nondeterministic, _ = named
        if not (nondeterministic and _deterministic()):  # else the dispatcher decides
            try:
                gqa = key.shape[1] != query.shape[1]  # (Tensor.size(1) parses more slowly)
                return _exclusive_sdpa(
                    wanted, query, key, value, attn_mask, dropout_p, is_causal, scale, gqa
                )
            except (RuntimeError, TypeError, AttributeError, IndexError, Warning):
                refused = True  # (Warning: PyTorch's reasons, under -W error)
    try:
        # What the decision depends on; a hit skips validation and resolution (the cache
        # is emptied whenever the policy changes). Key and value's dtype and device are
        # left out to keep the hit cheap: PyTorch refuses a mismatch, and the refusal is
        # turned into our error below.
        signature = (
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
        plan = _plans[signature]
    except KeyError:
        plan = None
    except (AttributeError, TypeError):
        plan = signature = None
    if plan is None:
        plan = _plan(signature, query, key, value, attn_mask, dropout_p, is_causal)
    wanted, gqa, decision = plan
    candidate = _named[1]
    if candidate is not None and (refused or _named[0] is None):
        _arm_or_disarm(candidate, decision.chosen == candidate[2])
    if wanted is not None and not (recording() or ranges_active()):
        # The common call. (Calling the backend's aten op directly skips PyTorch's
        # selection but cost ~3 µs more on an H100 host: the op hands Python nine outputs
        # where F.sdpa hands one.)
        try:
            return _exclusive_sdpa(
                wanted, query, key, value, attn_mask, dropout_p, is_causal, scale, gqa
            )
        except RuntimeError:
            _check(query, key, value, attn_mask, dropout_p)  # our error for a bad input
            raise
    logging_on = recording()
    if logging_on:
        _in_flight.decision = decision
    chosen = decision.chosen
    try:
        if chosen == "triton":
            _check(query, key, value, attn_mask, dropout_p)
            with annotate("attention[triton]"):
                from .flash_attention import attention

                return attention(query, key, value, is_causal, scale)
        with only_sdpa_backend(chosen), annotate(f"attention[{chosen}]"):
            try:
                return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa)
            except RuntimeError:
                _check(query, key, value, attn_mask, dropout_p)
                raise
    finally:
        if logging_on:
            _in_flight.decision = None


def _plan(signature, query, key, value, attn_mask, dropout_p, is_causal) -> tuple:
    """Validate a call whose signature is not cached yet, resolve its kernel, and cache
    what the call path needs: the SDPA flags to set (None for our Triton kernel), whether
    key/value heads are shared (GQA), and the decision."""
    _check(query, key, value, attn_mask, dropout_p)
    gqa = key.shape[1] != query.shape[1]
    ctx = AttentionContext(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), gqa, _deterministic()
    )
    decision = resolve_attention(signature, ctx)
    plan = (EXCLUSIVE_SDPA.get(decision.chosen), gqa, decision)
    with policy_lock:
        if signature is not None and _decisions.get(signature) is decision:
            _plans[signature] = plan  # not if the policy changed meanwhile
    return plan


def _arm_or_disarm(candidate: tuple, taken: bool) -> None:
    """Arm the named kernel's short path once a call has resolved to that kernel; disarm
    it for good (until the policy changes) once a call has needed another one."""
    with policy_lock:
        if _named[1] is not candidate:  # the policy changed meanwhile
            return
        if not taken:
            _named[:] = [None, None]
        elif _named[0] is None:
            _named[0] = candidate


def _traced(query, key, value, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor:
    """The call inside a torch.compile trace, where nothing is measured or logged: our
    Triton kernel where the policy names it and it takes the call; a named SDPA kernel
    (then math, unless strict) through F.sdpa in an ``sdpa_kernel`` block, which puts the
    choice into the traced graph (PyTorch's compile caches do not key on the SDPA flags);
    otherwise F.sdpa as PyTorch selects (``auto``). A trace cannot warn, so a non-strict
    policy's fallback from ``triton`` to F.sdpa here is not announced as it is in eager
    mode: ``strict=True`` makes it an error."""
    gqa = key.shape[1] != query.shape[1]
    policy = current_state().policy
    named = None if policy is None else policy.get("attention")
    if named == "triton":
        from ._launch import triton_unavailable
        from .flash_attention import attention, unsupported

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
            return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa)


def _exclusive_sdpa(
    wanted, query, key, value, attn_mask, dropout_p, is_causal, scale, gqa
) -> torch.Tensor:
    """F.sdpa with PyTorch's SDPA flags set to ``wanted`` (one backend alone) around the
    call; only the flags that differ are written (this runs on every attention call)."""
    saved = read_sdpa_flags()
    if saved == wanted:
        saved = None
    else:
        write_sdpa_flags(saved, wanted)
    try:
        # Only the arguments that differ from F.sdpa's defaults, in the form its callers
        # use: PyTorch's argument parser costs ~0.1 µs per argument, more for a keyword.
        if scale is not None or gqa:
            return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa)
        if attn_mask is None and not dropout_p:
            if is_causal:
                return F.scaled_dot_product_attention(query, key, value, is_causal=True)
            return F.scaled_dot_product_attention(query, key, value)
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal)
    finally:
        if saved is not None:
            write_sdpa_flags(wanted, saved)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, gqa) -> torch.Tensor:
    if gqa:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale
    )


_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms  # what torch.are_... returns


def _check(query, key, value, attn_mask, dropout_p) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = t.shape if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInputError(
                f"fused_attention: {name} must be a 4-D tensor (batch, heads, seq, head_dim), "
                f"got {got}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise InvalidInputError(
            f"fused_attention: query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise InvalidInputError(
            f"fused_attention: query, key and value must be on one device, got "
            f"{query.device}, {key.device}, {value.device}"
        )
    b, h, _, d = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != b or key.shape[3] != d:
        raise InvalidInputError(
            f"fused_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"(batch={b}, kv_heads, seq_k, head_dim={d}) with the same kv_heads and seq_k"
        )
    if h % key.shape[1]:
        raise InvalidInputError(
            f"fused_attention: query heads ({h}) must be a multiple of key/value heads "
            f"({key.shape[1]})"
        )
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise InvalidInputError(
            f"fused_attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}"
        )
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise InvalidInputError(f"fused_attention: dropout_p must be in [0, 1), got {dropout_p!r}")

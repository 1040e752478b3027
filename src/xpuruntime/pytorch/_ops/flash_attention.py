r"""flash_attention: our FlashAttention-2-style kernel in Triton, forward and backward.

.. math::
    S = \tau\,Q K^\top,\quad P = \mathrm{softmax}(S + M),\quad O = P V

for ``q`` (B, H, S_q, D) and ``k``/``v`` (B, H_kv, S_k, D), :math:`\tau` the scale and
:math:`M` the causal mask (top-left aligned, as in PyTorch) or nothing. Query head ``h``
reads key/value head ``h // (H / H_kv)`` (grouped-query attention).

Forward (Dao 2023, "FlashAttention-2", arXiv:2307.08691): one program per block of
queries walks the key blocks with an online softmax in the base-2 domain, keeps the
row's log-sum-exp ``L`` (fp32) and never writes ``P``. Blocks entirely visible (below
the diagonal, inside ``S_k``) run without a mask; only the diagonal and tail blocks mask.

Backward, with :math:`\Delta = \mathrm{rowsum}(dO \odot O)`:

.. math::
    P = 2^{S\log_2 e - L},\quad dV = P^\top dO,\quad dP = dO\,V^\top,\quad
    dS = P \odot (dP - \Delta),\quad dQ = \tau\, dS\,K,\quad dK = \tau\, dS^\top Q

in two kernels without atomics (so it is deterministic): one per key block computes
``dK``/``dV``, walking every query block of every query head that shares this key head;
one per query block computes ``dQ``. Where that leaves the device under two programs an
SM (Gemma3-1B: one key head for four query heads), each query head's share of
``dK``/``dV`` is written in fp32 by a program of its own, and the shares are summed after.
Rows and columns past the sequence ends are loaded as zeros, which contribute nothing;
only the diagonal and the key tail are masked.

Supported: fp16 and bf16, head_dim 16, 32, 64, 128 or 256, any sequence lengths, causal
or not, grouped-query attention; causal attention within packed documents and within a
sliding window (:func:`document_bounds`). Not supported (rejected by the policy kernel's
``supports()`` with a reason): dropout, explicit masks, fp32.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError
from ._infra._attention_inputs import check_attention
from ._infra._cached_launch import cached_launch
from ._infra._launch import cdiv, interpreting, require_triton, sm_count
from ._infra._op import kernel_op

__all__ = [
    "HEAD_DIMS", "attention", "document_bounds", "flash_attention", "unsupported",
    "unsupported_documents", "unsupported_window",
]  # fmt: skip

HEAD_DIMS = (16, 32, 64, 128, 256)
_LOG2E = 1.4426950408889634


# -- kernels ---------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(
    acc,  # (BLOCK_M, HEAD_DIM) fp32 running output
    l_i,  # (BLOCK_M,) fp32 running denominators
    m_i,  # (BLOCK_M,) fp32 running maxima (base-2 scores)
    q,  # (BLOCK_M, HEAD_DIM) queries
    k_base,  # this (batch, kv head)'s keys
    v_base,  # this (batch, kv head)'s values
    stride_kn,
    stride_vn,
    offs_m,  # (BLOCK_M,) query rows
    offs_n,  # (BLOCK_N,) 0..BLOCK_N
    offs_d,  # (HEAD_DIM,) 0..HEAD_DIM
    lo,
    hi,
    SEQ_K,
    qk_scale,  # the softmax scale times log2(e)
    row_start,  # (BLOCK_M,) the first key of each query row's document (DOCS)
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_t = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None],
            mask=cols[None, :] < SEQ_K,
            other=0.0,
        )
        s = tl.dot(q, k_t) * qk_scale
        if MASKED:
            visible = cols[None, :] < SEQ_K
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= cols[None, :])
            if DOCS:
                visible = visible & (cols[None, :] >= row_start[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if DOCS:  # a row may see nothing yet (its document starts further on): no NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :],
            mask=cols[:, None] < SEQ_K,
            other=0.0,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@cached_launch
@triton.jit
def _attn_fwd(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    o_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output
    lse_ptr,  # (B, H, SEQ_Q) fp32 log2-sum-exp2 of the scaled scores
    starts_ptr,  # (B, SEQ) int32: each position's document's first position (DOCS)
    stride_sb,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    H,
    GROUP,  # H // H_KV
    SEQ_Q,
    SEQ_K,
    qk_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kv_h = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < SEQ_Q
    row_start = offs_m  # read only under DOCS
    if DOCS:
        row_start = tl.load(starts_ptr + b * stride_sb + offs_m, mask=rows, other=0)
    q = tl.load(
        q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(SEQ_K, (start_m + 1) * BLOCK_M)
        full = tl.minimum(start_m * BLOCK_M, SEQ_K) // BLOCK_N * BLOCK_N
    else:
        hi = SEQ_K
        full = SEQ_K // BLOCK_N * BLOCK_N
    if DOCS:  # from the block's first document on, every block masked
        lo = tl.load(starts_ptr + b * stride_sb + start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        full = lo
    else:
        lo = 0
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        lo, full, SEQ_K, qk_scale, row_start, MASKED=False, CAUSAL=CAUSAL, DOCS=False,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        full, hi, SEQ_K, qk_scale, row_start, MASKED=True, CAUSAL=CAUSAL, DOCS=DOCS,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=rows[:, None],
    )
    tl.store(lse_ptr + bh.to(tl.int64) * SEQ_Q + offs_m, m_i + tl.math.log2(l_i), mask=rows)


@cached_launch
@triton.jit
def _attn_bwd_delta(
    o_ptr,  # (B, H, SEQ_Q, HEAD_DIM) forward output
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient
    delta_ptr,  # (B, H, SEQ_Q) fp32 rowsum(o * do)
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    H,
    SEQ_Q,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < SEQ_Q
    o = tl.load(
        o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    ).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * SEQ_Q + offs_m, tl.sum(o * do, axis=1), mask=rows)


@triton.jit
def _bwd_dkdv_inner(
    dk,  # (BLOCK_N, HEAD_DIM) fp32 running key gradient
    dv,  # (BLOCK_N, HEAD_DIM) fp32 running value gradient
    k,  # (BLOCK_N, HEAD_DIM) keys of this block
    v,  # (BLOCK_N, HEAD_DIM) values of this block
    q_base,  # this (batch, head)'s queries
    do_base,  # this (batch, head)'s output gradient
    lse_base,  # this (batch, head)'s log2-sum-exp2
    delta_base,  # this (batch, head)'s delta
    stride_qm,
    stride_dom,
    offs_n,  # (BLOCK_N,) key columns
    offs_d,  # (HEAD_DIM,)
    lo,
    hi,
    SEQ_Q,
    qk_scale,
    starts_base,  # this batch's document starts (DOCS)
    MASKED: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < SEQ_Q
        q_t = tl.load(
            q_base + offs_m[None, :] * stride_qm + offs_d[:, None], mask=rows[None, :], other=0.0
        )
        lse = tl.load(lse_base + offs_m, mask=rows, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, q_t) * qk_scale - lse[None, :])
        if MASKED:  # causal: key column n is seen by rows m >= n
            visible = offs_m[None, :] >= offs_n[:, None]
            if DOCS:  # and by rows of its own document alone
                row_start = tl.load(starts_base + offs_m, mask=rows, other=0)
                visible = visible & (offs_n[:, None] >= row_start[None, :])
            p_t = tl.where(visible, p_t, 0.0)
        do = tl.load(
            do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=rows[:, None], other=0.0
        )
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@cached_launch
@triton.jit
def _attn_bwd_dkdv(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient
    lse_ptr,  # (B, H, SEQ_Q) fp32
    delta_ptr,  # (B, H, SEQ_Q) fp32
    dk_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM), strided as dv; (B, H, ...) under SPLIT
    dv_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    starts_ptr,  # (B, SEQ) int32 (DOCS)
    ends_ptr,  # (B, SEQ) int32: each position's document's end, exclusive (DOCS)
    stride_sb,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_gb,  # the key and value gradients'
    stride_gh,
    stride_gn,
    H,
    H_KV,
    GROUP,
    SEQ_Q,
    SEQ_K,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # one program per query head, not per key head and its group
):
    start_n = tl.program_id(0) * BLOCK_N
    if SPLIT:  # each query head's share of its key head's gradients, summed after
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        out_h = (bh % H).to(tl.int64)
        kv_h = out_h // GROUP
        first = out_h % GROUP
        past = first + 1
    else:
        bkv = tl.program_id(1)
        b = (bkv // H_KV).to(tl.int64)
        kv_h = (bkv % H_KV).to(tl.int64)
        out_h = kv_h
        first = 0
        past = GROUP
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols = offs_n < SEQ_K
    k = tl.load(
        k_ptr + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
        mask=cols[:, None],
        other=0.0,
    )
    v = tl.load(
        v_ptr + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
        mask=cols[:, None],
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:  # rows below start_n see none of these columns
        diagonal_end = tl.minimum(start_n + BLOCK_N, SEQ_Q)
        lo = start_n
    else:
        diagonal_end = 0
        lo = 0
    starts_base = starts_ptr + b * stride_sb
    if DOCS:  # rows past the last column's document see none: every block masked
        last = tl.minimum(start_n + BLOCK_N, SEQ_K) - 1
        diagonal_end = tl.load(ends_ptr + b * stride_sb + last)
    for g in range(first, past):
        h = kv_h * GROUP + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        row0 = (b * H + h) * SEQ_Q
        do_base = do_ptr + b * stride_dob + h * stride_doh
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row0, delta_ptr + row0, stride_qm,
                stride_dom, offs_n, offs_d, lo, diagonal_end, SEQ_Q, qk_scale, starts_base,
                MASKED=True, DOCS=DOCS, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
            )  # fmt: skip
        if not DOCS:
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row0, delta_ptr + row0, stride_qm,
                stride_dom, offs_n, offs_d, tl.maximum(lo, diagonal_end), SEQ_Q, SEQ_Q, qk_scale,
                starts_base, MASKED=False, DOCS=False, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
            )  # fmt: skip
    out = b * stride_gb + out_h * stride_gh + offs_n[:, None] * stride_gn + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=cols[:, None])


@triton.jit
def _bwd_dq_inner(
    dq,  # (BLOCK_M, HEAD_DIM) fp32 running query gradient
    q,  # (BLOCK_M, HEAD_DIM)
    do,  # (BLOCK_M, HEAD_DIM)
    lse,  # (BLOCK_M,)
    delta,  # (BLOCK_M,)
    k_base,  # this (batch, kv head)'s keys
    v_base,  # this (batch, kv head)'s values
    stride_kn,
    stride_vn,
    offs_m,  # (BLOCK_M,) query rows
    offs_d,  # (HEAD_DIM,)
    lo,
    hi,
    SEQ_K,
    qk_scale,
    row_start,  # (BLOCK_M,) the first key of each query row's document (DOCS)
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_t = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None],
            mask=cols[None, :] < SEQ_K,
            other=0.0,
        )
        v_t = tl.load(
            v_base + cols[None, :] * stride_vn + offs_d[:, None],
            mask=cols[None, :] < SEQ_K,
            other=0.0,
        )
        p = tl.math.exp2(tl.dot(q, k_t) * qk_scale - lse[:, None])
        if MASKED:
            visible = cols[None, :] < SEQ_K
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= cols[None, :])
            if DOCS:
                visible = visible & (cols[None, :] >= row_start[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq


@cached_launch
@triton.jit
def _attn_bwd_dq(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient
    lse_ptr,  # (B, H, SEQ_Q) fp32
    delta_ptr,  # (B, H, SEQ_Q) fp32
    dq_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    starts_ptr,  # (B, SEQ) int32 (DOCS)
    stride_sb,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_gb,  # the query gradient's
    stride_gh,
    stride_gm,
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kv_h = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < SEQ_Q
    row0 = bh.to(tl.int64) * SEQ_Q
    q = tl.load(
        q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    do = tl.load(
        do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    lse = tl.load(lse_ptr + row0 + offs_m, mask=rows, other=0.0)
    delta = tl.load(delta_ptr + row0 + offs_m, mask=rows, other=0.0)
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    if CAUSAL:
        hi = tl.minimum(SEQ_K, (start_m + 1) * BLOCK_M)
        full = tl.minimum(start_m * BLOCK_M, SEQ_K) // BLOCK_N * BLOCK_N
    else:
        hi = SEQ_K
        full = SEQ_K // BLOCK_N * BLOCK_N
    row_start = offs_m  # read only under DOCS
    lo = 0
    if DOCS:  # from the block's first document on, every block masked
        row_start = tl.load(starts_ptr + b * stride_sb + offs_m, mask=rows, other=0)
        lo = tl.load(starts_ptr + b * stride_sb + start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        full = lo
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        lo, full, SEQ_K, qk_scale, row_start, MASKED=False, CAUSAL=CAUSAL, DOCS=False,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        full, hi, SEQ_K, qk_scale, row_start, MASKED=True, CAUSAL=CAUSAL, DOCS=DOCS,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    tl.store(
        dq_ptr + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :],
        (dq * sm_scale).to(dq_ptr.dtype.element_ty),
        mask=rows[:, None],
    )


# -- launch configuration ----------------------------------------------------------------------
def _blocks(head_dim: int, documents: bool = False) -> dict[str, tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel for a head dim (and for
    packed documents, where a block's loops are a document's few blocks long).

    Chosen on an H200 for bf16 (``benchmarks/tune_flash_attention.py``, BENCHMARKS.md);
    the interpreter takes small blocks so that CPU tests stay quick and still cross
    several blocks.
    """
    if interpreting():
        return {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
    if documents and head_dim == 64:  # (Llama-3.2-1B's: documents of 128 to 1023 tokens)
        return {"fwd": (64, 64, 4, 3), "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3)}
    if head_dim <= 64:
        return {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 4, 3), "dq": (64, 64, 4, 3)}
    if head_dim <= 128:
        return {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}
    # Gemma's 256 (tiles and fp32 accumulators twice as wide): chosen at its sliding
    # window of 512, where 22 of Gemma3-1B's 26 layers attend
    return {"fwd": (128, 64, 8, 2), "dkdv": (32, 64, 8, 2), "dq": (128, 32, 8, 2)}


# -- launchers ---------------------------------------------------------------------------------
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float,
    o: Tensor,
    lse: Tensor,
    starts: Tensor | None = None,
) -> None:
    """Write the output into ``o`` (any strides, its last dim unit) and the base-2 log-sum-exp of
    each row's scaled scores into ``lse`` (B, H, S_q) fp32. ``starts`` (B, S) int32, with
    ``is_causal``: each position sees only the keys from its document's first position
    (see :func:`document_bounds`)."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    docs = starts is not None
    block_m, block_n, warps, stages = _blocks(head_dim, documents=docs)["fwd"]
    grid = (cdiv(seq_q, block_m), batch * heads)
    _attn_fwd[grid](
        q, k, v, o, lse, starts if docs else q, starts.stride(0) if docs else 0,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        heads, heads // kv_heads, seq_q, seq_k, scale * _LOG2E,
        CAUSAL=is_causal, DOCS=docs, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    starts: Tensor | None = None,
    ends: Tensor | None = None,
) -> None:
    """Write the gradients into ``dq``, ``dk``, ``dv`` (``dk`` strided as ``dv``). Every
    tensor takes any strides with a unit last dim; ``starts`` and ``ends`` as the
    forward's documents (both or neither)."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    docs = starts is not None
    blocks = _blocks(head_dim, documents=docs)
    delta = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    _attn_bwd_delta[(cdiv(seq_q, 64), batch * heads)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], heads, seq_q,
        HEAD_DIM=head_dim, BLOCK_M=64, num_warps=4,
    )  # fmt: skip
    strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
    )  # fmt: skip
    documents = (starts, ends, starts.stride(0)) if docs else (q, q, 0)
    block_m, block_n, warps, stages = blocks["dkdv"]
    split = _split_groups(q.device, cdiv(seq_k, block_n) * batch * kv_heads, heads // kv_heads)
    gk, gv = dk, dv
    if split:  # (fp32: each head's share, summed once in fp32)
        shape = (batch, heads, seq_k, head_dim)
        gk, gv = (torch.empty(shape, device=q.device, dtype=torch.float32) for _ in range(2))
    _attn_bwd_dkdv[(cdiv(seq_k, block_n), batch * (heads if split else kv_heads))](
        q, k, v, do, lse, delta, gk, gv, *documents, *strides, *gv.stride()[:3],
        heads, kv_heads, heads // kv_heads, seq_q, seq_k, scale, scale * _LOG2E,
        CAUSAL=is_causal, DOCS=docs, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split:
        for shares, grad in ((gk, dk), (gv, dv)):
            grad.copy_(shares.unflatten(1, (kv_heads, -1)).sum(2))
    block_m, block_n, warps, stages = blocks["dq"]
    _attn_bwd_dq[(cdiv(seq_q, block_m), batch * heads)](
        q, k, v, do, lse, delta, dq, documents[0], documents[2], *strides, *dq.stride()[:3],
        heads, heads // kv_heads, seq_q, seq_k, scale, scale * _LOG2E,
        CAUSAL=is_causal, DOCS=docs, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _split_groups(device: torch.device, programs: int, group: int) -> bool:
    """Whether the key and value gradients take a program per query head: where grouped
    heads leave the device fewer than two programs an SM (Gemma3-1B's one key head of
    four: 256 programs on an H200's 132 SMs, each walking four heads). Under the
    interpreter four SMs are counted, so that small tests take both ways."""
    if group == 1:
        return False
    return programs < 2 * (4 if interpreting() else sm_count(device))


# -- the op: the registered torch op and the eager Function, from one definition ----------------
def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: Tensor | None,
    ends: Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    o = _token_major(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    attention_forward(q, k, v, is_causal, scale, o, lse, starts)
    return o, lse


def _token_major(like: Tensor) -> Tensor:
    """An empty (B, H, S, D) tensor laid out as (B, S, H, D), like SDPA's flash and cuDNN
    outputs. transformers' ``transpose(1, 2).reshape(B, S, H * D)`` of such an output is
    a view, and so are the projections' views such a gradient flows back to."""
    batch, heads, seq, dim = like.shape
    out = torch.empty((batch, seq, heads, dim), device=like.device, dtype=like.dtype)
    return out.transpose(1, 2)


def _forward_fake(q, k, v, starts, ends, is_causal, scale):
    return _token_major(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    starts: Tensor | None, ends: Tensor | None, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    dq, dk, dv = (_token_major(t) for t in (q, k, v))
    attention_backward(do, q, k, v, o, lse, is_causal, scale, dq, dk, dv, starts, ends)
    return dq, dk, dv


def _backward_fake(do, q, k, v, o, lse, starts, ends, is_causal, scale):
    return _token_major(q), _token_major(k), _token_major(v)


# One op for both masks: ``starts`` and ``ends`` (the documents' bounds) or None for both.
_attention = kernel_op(
    "attention",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, outputs: ((*inputs[:3], *outputs, *inputs[3:5]), inputs[5:]),
    prepare=lambda saved, state, do: (_unit_last(do), *saved, *state),
    finish=lambda state, grads: (*grads, None, None, None, None),
)


def _unit_last(t: Tensor) -> Tensor:
    """``t`` as it is where its last dim is unit-strided (what the kernels read), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def document_bounds(documents: Tensor, window: int | None = None) -> tuple[Tensor, Tensor]:
    """(starts, ends), each (B, S) int32: for every position of ``documents`` (B, S), the
    first position of its document and the position after its last, a document being a
    run of equal ids (transformers' ``packed_sequence_mask``, TRL's padding-free rows).
    A sliding ``window`` narrows them: query ``i`` sees key ``j`` where
    ``i - window < j <= i`` (transformers' ``sliding_window_overlay``). Then ``starts``
    holds the first key a query sees, ``ends`` the position after the last query that
    sees a key. Both stay nondecreasing along a row, as the kernels' block bounds need.
    Computed on the device, with no value read back."""
    seq = documents.shape[-1]
    index = torch.arange(seq, device=documents.device, dtype=torch.int32).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    starts = torch.where(first, index, 0).cummax(dim=-1).values
    ends = torch.where(last, index + 1, seq).flip(-1).cummin(dim=-1).values.flip(-1)
    if window is not None and window < seq:  # (a window of the whole row cuts nothing)
        starts = torch.maximum(starts, index - (window - 1))
        ends = torch.minimum(ends, index + window)
    return starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    scale: float | None,
    bounds: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Our kernel on checked inputs, without the checks (what fused_attention calls);
    ``bounds``, the documents' (starts, ends) from :func:`document_bounds`: causal
    attention within each document alone."""
    q, k, v = (_unit_last(t) for t in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    causal = bool(is_causal or bounds is not None)
    return _attention(q, k, v, *(bounds or (None, None)), causal, scale)


# -- the public entry ------------------------------------------------------------------------
def unsupported(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> str | None:
    """Why our kernel cannot run these inputs, or None when it can."""
    if attn_mask is not None:
        return "our Triton attention takes causal or no masking, not an explicit attn_mask"
    if dropout_p > 0:
        return "our Triton attention has no dropout"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"our Triton attention takes fp16 or bf16, not {query.dtype}"
    if query.dtype == torch.bfloat16 and query.device.type == "cpu" and interpreting():
        return (
            "Triton's CPU interpreter computes tl.dot on bf16 wrongly (triton-lang/triton"
            "#11584), so our Triton attention takes fp16 there, not bf16"
        )
    if query.shape[-1] not in HEAD_DIMS:
        return f"our Triton attention takes head_dim in {HEAD_DIMS}, not {query.shape[-1]}"
    if query.shape[2] == 0 or key.shape[2] == 0:
        return "our Triton attention needs at least one query and one key"
    return None


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    documents: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention by our Triton kernel (forward and backward), without the policy.

    Parameters
    ----------
    query : Tensor (B, H, S_q, D)
        fp16 or bf16, ``D`` in 16, 32, 64, 128, 256.
    key, value : Tensor (B, H_kv, S_k, D)
        ``H`` a multiple of ``H_kv``.
    is_causal : bool
        Causal masking, top-left aligned (as ``F.scaled_dot_product_attention``).
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    documents : Tensor (B, S), optional
        Integer document ids of packed sequences (``S = S_q = S_k``, ``is_causal``): each
        position attends causally within its document alone, a document being a run of
        equal ids. The kernel skips the key blocks before a query block's first document
        and, in the backward, the query blocks after a key block's last one: a row of
        16 documents of 512 costs about a sixteenth of causal attention over the row.
    window : int, optional
        A sliding window (``is_causal``, ``S_q = S_k``): query ``i`` sees keys ``j``
        with ``i - window < j <= i`` (transformers' sliding-window layers), within its
        document where ``documents`` are given. Key blocks outside it are skipped.

    Returns
    -------
    Tensor (B, H, S_q, D)
        Laid out (B, S_q, H, D) in memory, like SDPA's flash and cuDNN outputs:
        ``out.transpose(1, 2).reshape(B, S_q, H * D)`` is a view. The inputs may have
        any strides with a unit last dim, such as views of one projection's output.
        Their gradients come back laid out (B, S, H, D) too.

    Raises
    ------
    InvalidInputError
        Inputs this kernel does not take (the message says which and why).
    UnsupportedOperationError, BackendUnavailableError
        Not on a device Triton runs on, or Triton is missing.

    Examples
    --------
    >>> out = flash_attention(q, k, v, is_causal=True)     # doctest: +SKIP
    """
    check_attention(query, key, value, None, 0.0)
    why = unsupported(query, key, value)
    if why is None and window is not None:
        why = unsupported_window(window, is_causal)
        if why is None and documents is None:  # one document a row
            shape = (query.shape[0], query.shape[2])
            documents = torch.zeros(shape, dtype=torch.int32, device=query.device)
    if why is None and documents is not None:
        why = unsupported_documents(query, key, documents, is_causal)
    if why is not None:
        raise InvalidInputError(f"flash_attention: {why}")
    require_triton("flash_attention", query, key, value)
    bounds = None if documents is None else document_bounds(documents, window)
    return attention(query, key, value, is_causal, scale, bounds)


def unsupported_window(window: object, causal: bool) -> str | None:
    """Why ``window`` cannot mask this call, or None."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return f"window must be a positive int (the keys each query sees), got {window!r}"
    if not causal:
        return "a sliding window masks causal attention: pass is_causal=True with it"
    return None


def unsupported_documents(
    query: Tensor, key: Tensor, documents: Tensor, causal: bool
) -> str | None:
    """Why ``documents`` cannot mask this call, or None."""
    if not isinstance(documents, Tensor):
        return f"documents must be a Tensor of ids, got {type(documents).__name__}"
    if not causal:
        return "documents mask causal attention: pass is_causal=True with them"
    if documents.is_floating_point() or documents.is_complex() or documents.dtype == torch.bool:
        return f"documents must hold integer ids, got {documents.dtype}"
    seq = query.shape[2]
    if key.shape[2] != seq or tuple(documents.shape) != (query.shape[0], seq):
        return (
            f"documents must be (batch, seq) = {(query.shape[0], seq)} for self-attention "
            f"over {seq} positions; got documents {tuple(documents.shape)} and "
            f"{key.shape[2]} keys"
        )
    if documents.device != query.device:
        return f"documents are on {documents.device}, the query on {query.device}"
    return None

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
one per query block computes ``dQ``. Rows and columns past the sequence ends are loaded
as zeros, which contribute nothing; only the diagonal and the key tail are masked.

Supported: fp16 and bf16, head_dim 16, 32, 64 or 128, any sequence lengths, causal or
not, grouped-query attention. Not supported (rejected by the policy kernel's
``supports()`` with a reason): dropout, explicit masks, fp32.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError
from ._attention_inputs import check_attention
from ._launch import cdiv, interpreting, require_triton
from ._op import kernel_op

__all__ = ["HEAD_DIMS", "attention", "flash_attention", "unsupported"]

HEAD_DIMS = (16, 32, 64, 128)
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
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
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
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :],
            mask=cols[:, None] < SEQ_K,
            other=0.0,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    o_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output
    lse_ptr,  # (B, H, SEQ_Q) fp32 log2-sum-exp2 of the scaled scores
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
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        0, full, SEQ_K, qk_scale, MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        full, hi, SEQ_K, qk_scale, MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=rows[:, None],
    )
    tl.store(lse_ptr + bh.to(tl.int64) * SEQ_Q + offs_m, m_i + tl.math.log2(l_i), mask=rows)


@triton.jit
def _attn_bwd_delta(
    o_ptr,  # (B, H, SEQ_Q, HEAD_DIM) forward output, contiguous
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient, contiguous
    delta_ptr,  # (B, H, SEQ_Q) fp32 rowsum(o * do)
    ROWS,  # B * H * SEQ_Q
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < ROWS
    idx = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptr + idx, mask=rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + idx, mask=rows[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs_m, tl.sum(o * do, axis=1), mask=rows)


@triton.jit
def _bwd_dkdv_inner(
    dk,  # (BLOCK_N, HEAD_DIM) fp32 running key gradient
    dv,  # (BLOCK_N, HEAD_DIM) fp32 running value gradient
    k,  # (BLOCK_N, HEAD_DIM) keys of this block
    v,  # (BLOCK_N, HEAD_DIM) values of this block
    q_base,  # this (batch, head)'s queries
    do_base,  # this (batch, head)'s output gradient (contiguous rows)
    lse_base,  # this (batch, head)'s log2-sum-exp2
    delta_base,  # this (batch, head)'s delta
    stride_qm,
    offs_n,  # (BLOCK_N,) key columns
    offs_d,  # (HEAD_DIM,)
    lo,
    hi,
    SEQ_Q,
    qk_scale,
    MASKED: tl.constexpr,
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
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = tl.load(
            do_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=rows[:, None], other=0.0
        )
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient, contiguous
    lse_ptr,  # (B, H, SEQ_Q) fp32
    delta_ptr,  # (B, H, SEQ_Q) fp32
    dk_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM) contiguous
    dv_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM) contiguous
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    H,
    H_KV,
    GROUP,
    SEQ_Q,
    SEQ_K,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b = (bkv // H_KV).to(tl.int64)
    kv_h = (bkv % H_KV).to(tl.int64)
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
    for g in range(0, GROUP):
        h = kv_h * GROUP + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        row0 = (b * H + h) * SEQ_Q
        do_base = do_ptr + row0 * HEAD_DIM
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_ptr + row0, delta_ptr + row0, stride_qm,
                offs_n, offs_d, lo, diagonal_end, SEQ_Q, qk_scale,
                MASKED=True, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
            )  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_ptr + row0, delta_ptr + row0, stride_qm,
            offs_n, offs_d, tl.maximum(lo, diagonal_end), SEQ_Q, SEQ_Q, qk_scale,
            MASKED=False, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
        )  # fmt: skip
    out = (b * H_KV + kv_h) * SEQ_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
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
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
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
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq


@triton.jit
def _attn_bwd_dq(
    q_ptr,  # (B, H, SEQ_Q, HEAD_DIM)
    k_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    v_ptr,  # (B, H_KV, SEQ_K, HEAD_DIM)
    do_ptr,  # (B, H, SEQ_Q, HEAD_DIM) output gradient, contiguous
    lse_ptr,  # (B, H, SEQ_Q) fp32
    delta_ptr,  # (B, H, SEQ_Q) fp32
    dq_ptr,  # (B, H, SEQ_Q, HEAD_DIM) contiguous
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
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
        do_ptr + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
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
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        0, full, SEQ_K, qk_scale, MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        full, hi, SEQ_K, qk_scale, MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    tl.store(
        dq_ptr + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
        (dq * sm_scale).to(dq_ptr.dtype.element_ty),
        mask=rows[:, None],
    )


# -- launch configuration ----------------------------------------------------------------------
def _blocks(head_dim: int) -> dict[str, tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel for a head dim.

    Chosen on an H200 for bf16 (see BENCHMARKS.md); the interpreter takes small blocks so
    that CPU tests stay quick and still cross several blocks.
    """
    if interpreting():
        return {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
    if head_dim <= 64:
        return {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 4, 3), "dq": (64, 64, 4, 3)}
    return {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}


# -- launchers ---------------------------------------------------------------------------------
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, o: Tensor, lse: Tensor
) -> None:
    """Write the output into ``o`` (contiguous, like ``q``) and the base-2 log-sum-exp of
    each row's scaled scores into ``lse`` (B, H, S_q) fp32."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_m, block_n, warps, stages = _blocks(head_dim)["fwd"]
    grid = (cdiv(seq_q, block_m), batch * heads)
    _attn_fwd[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        heads, heads // kv_heads, seq_q, seq_k, scale * _LOG2E,
        CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
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
) -> None:
    """Write the gradients into ``dq``, ``dk``, ``dv`` (contiguous). ``do`` and ``o`` are
    contiguous."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    blocks = _blocks(head_dim)
    delta = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    rows = batch * heads * seq_q
    _attn_bwd_delta[(cdiv(rows, 64),)](
        o, do, delta, rows, HEAD_DIM=head_dim, BLOCK_M=64, num_warps=4
    )
    strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
    )  # fmt: skip
    block_m, block_n, warps, stages = blocks["dkdv"]
    _attn_bwd_dkdv[(cdiv(seq_k, block_n), batch * kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *strides,
        heads, kv_heads, heads // kv_heads, seq_q, seq_k, scale, scale * _LOG2E,
        CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    block_m, block_n, warps, stages = blocks["dq"]
    _attn_bwd_dq[(cdiv(seq_q, block_m), batch * heads)](
        q, k, v, do, lse, delta, dq, *strides,
        heads, heads // kv_heads, seq_q, seq_k, scale, scale * _LOG2E,
        CAUSAL=is_causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


# -- the op: the registered torch op and the eager Function, from one definition ----------------
def _forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    attention_forward(q, k, v, is_causal, scale, o, lse)
    return o, lse


def _forward_fake(q, k, v, is_causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    attention_backward(do, q, k, v, o, lse, is_causal, scale, dq, dk, dv)
    return dq, dk, dv


def _backward_fake(do, q, k, v, o, lse, is_causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_attention = kernel_op(
    "attention",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, outputs: ((*inputs[:3], *outputs), inputs[3:]),
    prepare=lambda saved, state, do: (do.contiguous(), *saved, *state),
    finish=lambda state, grads: (*grads, None, None),
)


def attention(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None
) -> Tensor:
    """Our kernel on checked inputs, without the checks (what fused_attention calls)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attention(q, k, v, bool(is_causal), scale)


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
) -> Tensor:
    """Attention by our Triton kernel (forward and backward), without the policy.

    Parameters
    ----------
    query : Tensor (B, H, S_q, D)
        fp16 or bf16, ``D`` in 16, 32, 64, 128.
    key, value : Tensor (B, H_kv, S_k, D)
        ``H`` a multiple of ``H_kv``.
    is_causal : bool
        Causal masking, top-left aligned (as ``F.scaled_dot_product_attention``).
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    Tensor (B, H, S_q, D)

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
    if why is not None:
        raise InvalidInputError(f"flash_attention: {why}")
    require_triton("flash_attention", query, key, value)
    return attention(query, key, value, is_causal, scale)

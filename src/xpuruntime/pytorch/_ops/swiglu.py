r"""swiglu and geglu: the gated activations of Llama-style MLPs,
:math:`h = \mathrm{silu}(g) \odot u`, and of Gemma's, :math:`h = \mathrm{gelu}_{\tanh}(g) \odot u`.

.. math::
    \mathrm{silu}(g) = g\,\sigma(g),\qquad
    \partial u = \partial h \odot \mathrm{silu}(g),\qquad
    \partial g = \partial h \odot u \odot \sigma(g)\,\bigl(1 + g\,(1 - \sigma(g))\bigr)

Shazeer, "GLU Variants Improve Transformer" (2020, arXiv:2002.05202). One elementwise
pass forward and one backward, fp32 math. The backward recomputes :math:`\sigma(g)` from
the gate: only the two inputs are kept for it, where PyTorch's
``F.silu(gate) * up`` also keeps ``silu(gate)``, an activation-sized tensor per layer
(2 GiB over Llama-3.2-1B's 16 layers at B4 x T2048 in bf16). GeGLU is the same pass with
the tanh approximation of GELU (PyTorch's ``F.gelu(g, approximate="tanh")``,
transformers' ``gelu_pytorch_tanh``), its derivative recomputed likewise.

Packed (``up`` omitted): ``gate`` holds the gate and up as the two halves of its last
dimension, as one GEMM over the concatenated projections writes them (Phi-3's
``gate_up_proj``, and Llama's gate and up projections where :func:`optimize` runs them as
one); the kernels read the halves where they lie, and the backward writes the packed
gradient, so that neither direction copies a half.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError
from ._infra._cached_launch import cached_launch
from ._infra._first_order import first_order
from ._infra._fp8_handoff import gradient_scales, hand_amax, hand_cast
from ._infra._launch import FLOAT_DTYPES, cdiv, interpreting, sm_count, triton_or_fallback
from ._infra._op import kernel_op
from ._infra._partials import sum_rows
from ._infra._recompute import mark_recomputable
from .fp8 import E4M3, cast_constants, row_tile, scaled_to_grid

__all__ = [
    "check_swiglu",
    "geglu",
    "run_fp8_kept",
    "run_geglu",
    "run_swiglu",
    "swiglu",
    "torch_geglu",
    "torch_swiglu",
]

_BLOCK = 1024


@triton.jit
def _activation(g, GELU: tl.constexpr):
    """``(act(g), act'(g))``: SiLU, or GELU's tanh approximation (tanh from a sigmoid,
    which every Triton backend has)."""
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        act = 0.5 * g * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * g * g
        )
    else:
        s = tl.sigmoid(g)
        act = g * s
        slope = s * (1.0 + g * (1.0 - s))
    return act, slope


# -- kernels ---------------------------------------------------------------------------------
@triton.jit
def _packed(offsets, cols, PACKED: tl.constexpr):
    """Where the gate and the up of output element ``offsets`` lie: the same offset, or
    in a packed input (rows of ``2 * cols``: gate, then up) its row's two halves."""
    if PACKED:
        at = (offsets // cols) * (2 * cols) + offsets % cols
        return at, at + cols
    return offsets, offsets


@triton.jit
def _inputs(g_ptr, u_ptr, gs_ptr, us_ptr, at, up_at, rows, mask, SCALED: tl.constexpr):
    """Gate and up at ``at`` and ``up_at`` in fp32: as stored, or (SCALED) their FP8
    values times their rows' scales."""
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + up_at, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g * tl.load(gs_ptr + rows, mask=mask, other=0.0)
        u = u * tl.load(us_ptr + rows, mask=mask, other=0.0)
    return g, u


@cached_launch
@triton.jit
def _swiglu_fwd(
    g_ptr,  # (n,) gate, contiguous; packed: (n / cols, 2 * cols), gate then up
    u_ptr,  # (n,) up; packed: the same as g_ptr
    h_ptr,  # (n,) output
    n,
    cols,  # packed or scaled: the output's row width (unused otherwise)
    gs_ptr,  # SCALED: fp32, a scale per row the gate's stored values are multiplied by
    us_ptr,  # SCALED: up's (packed: the same as gs_ptr)
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    PACKED: tl.constexpr,
    SCALED: tl.constexpr,  # gate and up stored in FP8 with their scales (fp8_activations)
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n
    at, up_at = _packed(offsets, cols, PACKED)
    g, u = _inputs(g_ptr, u_ptr, gs_ptr, us_ptr, at, up_at, offsets // cols, mask, SCALED)
    act, _ = _activation(g, GELU)
    tl.store(h_ptr + offsets, (act * u).to(h_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _swiglu_bwd(
    dh_ptr,  # (n,) the output's gradient
    g_ptr,  # (n,) gate (packed: as the forward's)
    u_ptr,  # (n,) up
    dg_ptr,  # (n,) the gate's gradient (packed: laid out as g_ptr)
    du_ptr,  # (n,) up's gradient (packed: the same as dg_ptr)
    n,
    cols,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    PACKED: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n
    at, up_at = _packed(offsets, cols, PACKED)
    dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g, u = _inputs(g_ptr, u_ptr, g_ptr, u_ptr, at, up_at, offsets, mask, False)
    act, slope = _activation(g, GELU)
    tl.store(du_ptr + up_at, (dh * act).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + at, (dh * u * slope).to(dg_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _swiglu_left_product(
    m_ptr,  # (M, R) the left factor, unit stride along R
    g_ptr,  # (M, N) gate, contiguous; packed: (M, 2N), gate then up
    u_ptr,  # (M, N) up; packed: the same as g_ptr
    out_ptr,  # (S, R, N) fp32 partial products, one per split of the rows
    gs_ptr,  # SCALED: as the forward's
    us_ptr,
    M,
    N,
    R,
    rows_per_split,
    m_row_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GELU: tl.constexpr,
    PACKED: tl.constexpr,
    SCALED: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the products in fp32: fp32 factors, or bf16 ones in
    # Triton's CPU interpreter, which computes tl.dot on bf16 wrongly (triton#11584)
):
    # m^T h over a split of the rows, h = act(g) * u made tile by tile and rounded as the
    # forward wrote it, never stored: the adapter gradient of the projection after the
    # activation, read from what the activation keeps.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_mask = cols < N
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    width = 2 * N if PACKED else N
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, M)
    for start in range(first, last, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < last
        tile = row_mask[:, None] & col_mask[None, :]
        at = rows[:, None] * width + cols[None, :]
        if PACKED:
            up_at = at + N
        else:
            up_at = at
        g, u = _inputs(g_ptr, u_ptr, gs_ptr, us_ptr, at, up_at, rows, tile, False)
        if SCALED:  # (a scale per row, loaded once and broadcast over the tile's columns)
            g = g * tl.load(gs_ptr + rows, mask=row_mask, other=0.0)[:, None]
            u = u * tl.load(us_ptr + rows, mask=row_mask, other=0.0)[:, None]
        act, _ = _activation(g, GELU)
        if SCALED:  # (the forward wrote h in the compute dtype, m's)
            h = (act * u).to(m_ptr.dtype.element_ty)
        else:
            h = (act * u).to(g_ptr.dtype.element_ty).to(m_ptr.dtype.element_ty)
        m = tl.load(
            m_ptr + rows[:, None] * m_row_stride + ranks[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        m_t = tl.trans(m)
        if FP32_DOT:
            acc = tl.dot(m_t.to(tl.float32), h.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(m_t, h, acc)
    out = out_ptr + split * R * N + ranks[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=rank_mask[:, None] & col_mask[None, :])


@cached_launch
@triton.jit
def _swiglu_kept_fwd(
    g_ptr,  # (R, N) gate, row-major; packed: (R, 2N), gate then up
    u_ptr,  # (R, N) up; packed: the same as g_ptr
    h_ptr,  # (R, N) output
    qg_ptr,  # (R, N) e4m3: the gate kept; packed: (R, 2N), both halves
    qu_ptr,  # (R, N) e4m3: up kept; packed: the same as qg_ptr
    gs_ptr,  # fp32 (R,): each row's inverse scale of the gate's (packed: of the pair's)
    us_ptr,  # fp32 (R,): up's (packed: the same as gs_ptr)
    qh_ptr,  # (R, N) e4m3: h's per-token cast (CAST_H), or nothing
    hs_ptr,  # fp32 (R,): its inverse scales (CAST_H), or nothing
    R,
    N,
    FMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    TINY: tl.constexpr,
    SPACING: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GELU: tl.constexpr,
    PACKED: tl.constexpr,
    CAST_H: tl.constexpr,  # h cast per token too, for the FP8 GEMM that reads it next
):
    # The forward that keeps gate and up in FP8. A first pass finds each row's amax (and
    # h's, of h as written). A second, over rows the program just read, writes the casts
    # and h from the 16-bit values. Separate casts and the activation read the inputs
    # (and h) from memory twice.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    width = 2 * N if PACKED else N
    up_ptr = u_ptr + N if PACKED else u_ptr
    g_amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    u_amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    h_amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, N, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        g, _ = row_tile(g_ptr, g_ptr, rows, cols, R, N, width, 1, False)
        u, _ = row_tile(up_ptr, up_ptr, rows, cols, R, N, width, 1, False)
        g_amax = tl.maximum(g_amax, tl.max(tl.abs(g), axis=1))
        u_amax = tl.maximum(u_amax, tl.max(tl.abs(u), axis=1))
        if CAST_H:
            act, _ = _activation(g, GELU)
            h = (act * u).to(h_ptr.dtype.element_ty).to(tl.float32)
            h_amax = tl.maximum(h_amax, tl.max(tl.abs(h), axis=1))
    if PACKED:  # (one scale for the pair's row)
        g_amax = tl.maximum(g_amax, u_amax)
        u_amax = g_amax
    top = tl.full((), FMAX, tl.float32)
    g_amax = tl.maximum(g_amax, tl.full((), EPS, tl.float32))
    u_amax = tl.maximum(u_amax, tl.full((), EPS, tl.float32))
    tl.store(gs_ptr + rows, tl.math.div_rn(g_amax, top), mask=rows < R)
    if not PACKED:
        tl.store(us_ptr + rows, tl.math.div_rn(u_amax, top), mask=rows < R)
    g_scale = tl.math.div_rn(top, g_amax)[:, None]
    u_scale = tl.math.div_rn(top, u_amax)[:, None]
    h_amax = tl.maximum(h_amax, tl.full((), EPS, tl.float32))
    h_scale = tl.math.div_rn(top, h_amax)[:, None]
    if CAST_H:
        tl.store(hs_ptr + rows, tl.math.div_rn(h_amax, top), mask=rows < R)
    qu_at = qu_ptr + N if PACKED else qu_ptr
    for start in range(0, N, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        g, mask = row_tile(g_ptr, g_ptr, rows, cols, R, N, width, 1, False)
        u, _ = row_tile(up_ptr, up_ptr, rows, cols, R, N, width, 1, False)
        at = rows[:, None] * width + cols[None, :]
        qg = scaled_to_grid(g, g_scale, FMAX, MANTISSA, TINY, SPACING)
        qu = scaled_to_grid(u, u_scale, FMAX, MANTISSA, TINY, SPACING)
        tl.store(qg_ptr + at, qg.to(qg_ptr.dtype.element_ty), mask=mask)
        tl.store(qu_at + at, qu.to(qg_ptr.dtype.element_ty), mask=mask)
        act, _ = _activation(g, GELU)
        h = (act * u).to(h_ptr.dtype.element_ty)
        h_at = rows[:, None] * N + cols[None, :]
        tl.store(h_ptr + h_at, h, mask=mask)
        if CAST_H:
            qh = scaled_to_grid(h.to(tl.float32), h_scale, FMAX, MANTISSA, TINY, SPACING)
            tl.store(qh_ptr + h_at, qh.to(qh_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _swiglu_kept_bwd(
    dh_ptr,  # (R, N) the output's gradient, row-major
    g_ptr,  # (R, N) e4m3 gate as kept; packed: (R, 2N), both halves
    u_ptr,  # (R, N) e4m3 up as kept; packed: the same as g_ptr
    dg_ptr,  # (R, N) the gate's gradient (packed: (R, 2N), the pair's)
    du_ptr,  # (R, N) up's (packed: the same as dg_ptr)
    gs_ptr,  # fp32 (R,): the gate's row scales (packed: the pair's)
    us_ptr,  # fp32 (R,): up's
    mul_ptr,  # fp32 (2N,): the columns' multipliers of a pair's gradient (AMAX)
    parts_ptr,  # fp32 (R, P), P the column blocks: each row's amax of it times them (AMAX)
    R,
    N,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GELU: tl.constexpr,
    PACKED: tl.constexpr,
    AMAX: tl.constexpr,  # (packed only)
):
    # The backward from gate and up kept in FP8, a tile of rows and columns a program.
    # AMAX: each row's amax of the gradient as written, times the multipliers of the cast
    # the FP8 GEMM before makes of it, one part per block of columns (no atomics); the
    # cast then reads the gradient once, not twice.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < R
    mask = row_mask[:, None] & (cols[None, :] < N)
    width = 2 * N if PACKED else N
    at = rows[:, None] * width + cols[None, :]
    up_at = at + N if PACKED else at
    dh = tl.load(dh_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + up_at, mask=mask, other=0.0).to(tl.float32)
    g = g * tl.load(gs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    u = u * tl.load(us_ptr + rows, mask=row_mask, other=0.0)[:, None]
    act, slope = _activation(g, GELU)
    du = (dh * act).to(du_ptr.dtype.element_ty)
    dg = (dh * u * slope).to(dg_ptr.dtype.element_ty)
    tl.store(du_ptr + up_at, du, mask=mask)
    tl.store(dg_ptr + at, dg, mask=mask)
    if AMAX:
        g_mul = tl.load(mul_ptr + cols, mask=cols < N, other=0.0)[None, :]
        u_mul = tl.load(mul_ptr + N + cols, mask=cols < N, other=0.0)[None, :]
        big = tl.maximum(tl.abs(dg.to(tl.float32) * g_mul), tl.abs(du.to(tl.float32) * u_mul))
        parts = tl.num_programs(1)
        tl.store(parts_ptr + rows * parts + tl.program_id(1), tl.max(big, axis=1), mask=row_mask)


# -- launchers -------------------------------------------------------------------------------
def _launchers(gelu: bool):
    def forward(gate: Tensor, up: Tensor) -> tuple[Tensor]:
        h = torch.empty_like(gate)
        n = gate.numel()
        if n:
            grid = (cdiv(n, _BLOCK),)
            _swiglu_fwd[grid](gate, up, h, n, 1, gate, gate, BLOCK=_BLOCK, GELU=gelu,
                              PACKED=False, SCALED=False, num_warps=4)  # fmt: skip
        return (h,)

    def forward_fake(gate: Tensor, up: Tensor) -> tuple[Tensor]:
        return (torch.empty_like(gate),)

    def backward(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            grid = (cdiv(n, _BLOCK),)
            _swiglu_bwd[grid](dh, gate, up, dg, du, n, 1, BLOCK=_BLOCK, GELU=gelu,
                              PACKED=False, num_warps=4)  # fmt: skip
        return dg, du

    def backward_fake(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        return torch.empty_like(gate), torch.empty_like(up)

    return {
        "forward": forward,
        "forward_fake": forward_fake,
        "backward": backward,
        "backward_fake": backward_fake,
    }


def _packed_launchers(gelu: bool):
    def forward(packed: Tensor) -> tuple[Tensor]:
        cols = packed.shape[-1] // 2
        h = packed.new_empty((*packed.shape[:-1], cols))
        n = h.numel()
        if n:
            grid = (cdiv(n, _BLOCK),)
            _swiglu_fwd[grid](packed, packed, h, n, cols, packed, packed, BLOCK=_BLOCK,
                              GELU=gelu, PACKED=True, SCALED=False, num_warps=4)  # fmt: skip
        return (h,)

    def forward_fake(packed: Tensor) -> tuple[Tensor]:
        return (packed.new_empty((*packed.shape[:-1], packed.shape[-1] // 2)),)

    def backward(dh: Tensor, packed: Tensor) -> tuple[Tensor]:
        cols = packed.shape[-1] // 2
        grad = torch.empty_like(packed)
        n = dh.numel()
        if n:
            grid = (cdiv(n, _BLOCK),)
            _swiglu_bwd[grid](dh, packed, packed, grad, grad, n, cols, BLOCK=_BLOCK,
                              GELU=gelu, PACKED=True, num_warps=4)  # fmt: skip
        return (grad,)

    def backward_fake(dh: Tensor, packed: Tensor) -> tuple[Tensor]:
        return (torch.empty_like(packed),)

    return {
        "forward": forward,
        "forward_fake": forward_fake,
        "backward": backward,
        "backward_fake": backward_fake,
    }


def _gated_op(name: str, launchers: dict):
    """The registered op and its Function over ``launchers``: the backward keeps only
    the inputs (gate and up, or the packed pair); the activation is recomputed."""
    return kernel_op(
        name,
        **launchers,
        save=lambda inputs, outputs: (inputs, None),
        prepare=lambda saved, state, dh: (dh.contiguous(), *saved),
        finish=lambda state, grads: grads,
    )


_GATES = (("swiglu", False), ("geglu", True))
_GATED = {name: _gated_op(name, _launchers(gelu)) for name, gelu in _GATES}
_PACKED = {name: _gated_op(f"{name}_packed", _packed_launchers(gelu)) for name, gelu in _GATES}


# -- the ops ---------------------------------------------------------------------------------
def _halves(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    return gate.chunk(2, dim=-1) if up is None else (gate, up)


def torch_swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """PyTorch's expression of swiglu (what Llama's MLP writes); ``up`` None: packed."""
    g, u = _halves(gate, up)
    return torch.nn.functional.silu(g) * u


def torch_geglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """PyTorch's expression of geglu (what Gemma's MLP writes); ``up`` None: packed."""
    g, u = _halves(gate, up)
    return torch.nn.functional.gelu(g, approximate="tanh") * u


# The forward launchers alone (no autograd): what a later op recomputes the output by.
_AGAIN = {
    **{name: _launchers(gelu)["forward"] for name, gelu in _GATES},
    **{f"{name}_packed": _packed_launchers(gelu)["forward"] for name, gelu in _GATES},
}


def _again(name: str, *inputs: Tensor) -> Tensor:
    return _AGAIN[name](*inputs)[0]


# (rows, columns) of h a program takes at once, and programs an SM, so that the row splits
# fill the device. H200, bf16, rank 16, 8192 rows (benchmarks/tune_swiglu.py), us for 6144
# / 8192 / 14336 columns: 101 / 123 / 199 with 64 x 128 and 4 an SM, 75 / 92 / 157 now.
_PRODUCT_BLOCKS = (32, 64)
_PRODUCT_PER_SM = 8
_PRODUCT_MAX_RANK = 64  # m's columns a program holds at once (its accumulator's rows)


def _left_product(
    gelu: bool,
    m: Tensor,
    gate: Tensor,
    up: Tensor | None = None,
    scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor | None:
    """``m^T @ h`` in fp32 for ``h = act(gate) * up`` as the forward wrote it (rounded
    to the gate's dtype, then to ``m``'s), without making ``h``: one pass over gate and
    up. ``m``: (rows, k), a row per row of ``h``; ``up`` None: ``gate`` packed;
    ``scales``: gate and up stored in FP8, each row's values times its scale (``h`` then
    rounded to ``m``'s dtype). None where ``m`` is wider than :data:`_PRODUCT_MAX_RANK` or
    ``h`` is empty (then made)."""
    cols = gate.shape[-1] // 2 if up is None else gate.shape[-1]
    rows = gate.numel() // max(1, gate.shape[-1])
    k = m.shape[-1]
    if not 0 < k <= _PRODUCT_MAX_RANK or rows == 0 or cols == 0:
        return None
    m = m if m.stride(-1) == 1 else m.contiguous()
    block_m, block_n = _PRODUCT_BLOCKS
    column_blocks = cdiv(cols, block_n)
    programs = _PRODUCT_PER_SM * sm_count(gate.device) if gate.is_cuda else 2
    splits, per_split = product_splits(rows, column_blocks, block_m, programs)
    partial = torch.empty((splits, k, cols), device=gate.device, dtype=torch.float32)
    gs, us = (gate, gate) if scales is None else scales
    _swiglu_left_product[(column_blocks, splits)](
        m, gate, gate if up is None else up, partial, gs, us, rows, cols, k, per_split,
        m.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, 1 << (k - 1).bit_length()), GELU=gelu, PACKED=up is None,
        SCALED=scales is not None,
        FP32_DOT=m.dtype == torch.float32 or (m.dtype == torch.bfloat16 and interpreting()),
        num_warps=4,
    )  # fmt: skip
    if splits == 1:
        return partial[0]
    return sum_rows(partial.view(splits, k * cols)).view(k, cols)


def product_splits(rows: int, column_blocks: int, block_m: int, programs: int) -> tuple[int, int]:
    """(splits, rows per split) of ``rows`` so that ``programs`` programs fill the
    device; each split's partial product is summed after."""
    splits = max(1, min(cdiv(programs, column_blocks), cdiv(rows, block_m)))
    per_split = cdiv(cdiv(rows, splits), block_m) * block_m
    return cdiv(rows, per_split), per_split


# Each activation's ``m^T @ h``, from its inputs packed or not.
_PRODUCTS = {name: functools.partial(_left_product, gelu) for name, gelu in _GATES}


def _run(name: str, gate: Tensor, up: Tensor | None) -> Tensor:
    if up is None:
        inputs, launcher = (gate.contiguous(),), f"{name}_packed"
        h = _PACKED[name](*inputs)
    else:
        inputs, launcher = (gate.contiguous(), up.contiguous()), name
        h = _GATED[name](*inputs)
    again = functools.partial(_again, launcher)
    mark_recomputable(h, again, *inputs, product=_PRODUCTS[name])
    return h


# -- gate and up kept in FP8 (the policy's fp8_activations) ---------------------------------
# What is kept: (pair, its scales) for a packed pair, one scale per row of both halves;
# (gate, its scales, up, its scales) for two tensors. Each is e4m3, a scale per row.


def _kept_operands(kept: tuple[Tensor, ...]) -> tuple[bool, Tensor, Tensor, Tensor, Tensor]:
    """``(packed, gate, gate's scales, up, up's scales)`` of what is kept (a packed
    pair is both gate and up, the kernels reading its halves)."""
    packed = len(kept) == 2
    g, gs = kept[0], kept[1]
    u, us = (g, gs) if packed else (kept[2], kept[3])
    return packed, g, gs, u, us


# (rows, columns) a program of _swiglu_kept_fwd takes, and its warps: on an H200 the
# fastest of seven tried (Llama-8B's 4096 x 2 x 14336 pair: 178 us, against 233 for the
# per-row cast and the activation apart)
_KEPT_BLOCKS = (1, 2048, 8)
# (rows, columns) a program of _swiglu_kept_bwd takes, and its warps: on an H200 the
# fastest of seven tried with the amax (Llama-8B's 4096 x 2 x 14336 pair: 147 us, 122
# without; the row's cast given the parts then 103, against 195 finding its amax itself)
_KEPT_BWD_BLOCKS = (1, 1024, 4)


def _kept_forward(
    gelu: bool, gate: Tensor, up: Tensor | None, cast_h: bool
) -> tuple[Tensor, tuple, tuple]:
    """``h`` from contiguous 16-bit gate and up (``up`` None: packed), what is kept of
    them in FP8, and (``cast_h``) ``h``'s per-token cast ``(qdata, inverse)``, by one
    launch."""
    packed = up is None
    cols = gate.shape[-1] // 2 if packed else gate.shape[-1]
    rows = gate.numel() // max(1, gate.shape[-1])
    h = gate.new_empty((*gate.shape[:-1], cols))
    qg = torch.empty((rows, gate.shape[-1]), dtype=E4M3, device=gate.device)
    gs = torch.empty((rows, 1), dtype=torch.float32, device=gate.device)
    qu, us = (qg, gs) if packed else (torch.empty_like(qg), torch.empty_like(gs))
    cast = ()
    if cast_h:
        cast = (torch.empty((rows, cols), dtype=E4M3, device=gate.device),
                torch.empty((rows, 1), dtype=torch.float32, device=gate.device))  # fmt: skip
    if rows:
        block_r, block_c, warps = _KEPT_BLOCKS
        qh, hs = cast or (qg, gs)
        _swiglu_kept_fwd[(cdiv(rows, block_r),)](
            gate, gate if packed else up, h, qg, qu, gs, us, qh, hs, rows, cols,
            **cast_constants(E4M3), BLOCK_R=block_r, BLOCK_C=block_c, GELU=gelu,
            PACKED=packed, CAST_H=cast_h, num_warps=warps,
        )  # fmt: skip
    return h, (qg, gs) if packed else (qg, gs, qu, us), cast


def _kept_backward(
    gelu: bool, dh: Tensor, shape: torch.Size, dtype: torch.dtype, kept: tuple,
    multipliers: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The gradients of gate and up (a packed pair's: one tensor, twice) from what is
    kept, and (``multipliers``, packed only) each row's amax of the pair's gradient
    times them, column by column, in parts (fp32 (rows, parts)); by one launch."""
    packed, g, gs, u, us = _kept_operands(kept)
    dh = dh.contiguous()
    cols = dh.shape[-1]
    rows = dh.numel() // max(1, cols)
    dg = torch.empty(shape, dtype=dtype, device=dh.device)
    du = dg if packed else torch.empty_like(dg)  # (a pair's gradient: one tensor)
    block_r, block_c, warps = _KEPT_BWD_BLOCKS
    grid = (cdiv(rows, block_r), cdiv(cols, block_c))
    parts = None
    if multipliers is not None:
        parts = torch.empty((rows, grid[1]), dtype=torch.float32, device=dh.device)
    if dh.numel():
        _swiglu_kept_bwd[grid](
            dh, g, u, dg, du, gs, us, gs if parts is None else multipliers,
            gs if parts is None else parts, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c,
            GELU=gelu, PACKED=packed, AMAX=parts is not None, num_warps=warps,
        )  # fmt: skip
    return dg, du, parts


class _KeptFp8(torch.autograd.Function):
    """The gated activation whose backward reads gate and up kept in FP8, not in 16
    bits. The forward computes ``h`` from the inputs as given, and returns what it
    keeps after ``h`` (no gradient flows to it), then (``cast_h``) ``h``'s per-token
    cast. The backward, and the next projection's recomputation
    (:mod:`._infra._recompute`), read the rounded values. Nothing holds the 16-bit gate
    and up past the layer's forward. ``scales``: what the projection before multiplies
    a packed pair's gradient by before its cast (:mod:`._infra._fp8_handoff`); the
    backward finds each row's amax of that product as it writes the gradient."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor | None, name: str, scales, cast_h: bool):
        h, kept, cast = _kept_forward(name == "geglu", gate, up, cast_h)
        ctx.save_for_backward(*kept)
        ctx.mark_non_differentiable(*kept, *cast)
        ctx.set_materialize_grads(False)  # (no zeros made for what is kept, 1 byte each)
        ctx.gelu, ctx.shape, ctx.dtype = name == "geglu", gate.shape, gate.dtype
        ctx.scales = scales if up is None else None
        return (h, *kept, *cast)

    @staticmethod
    @first_order("swiglu (gate and up kept in FP8)")
    def backward(ctx, dh: Tensor | None, *kept_grads: None):
        if dh is None:  # (h took no gradient)
            return None, None, None, None, None
        multipliers = None if ctx.scales is None else ctx.scales()
        dg, du, parts = _kept_backward(ctx.gelu, dh, ctx.shape, ctx.dtype, ctx.saved_tensors,
                                       multipliers)  # fmt: skip
        if parts is not None:
            hand_amax(dg, parts, multipliers)
        return dg, None if du is dg else du, None, None, None


def _kept_again(gelu: bool, shape: torch.Size, dtype: torch.dtype, *kept: Tensor) -> Tensor:
    """``h`` made again from gate and up kept in FP8, in the forward's ``dtype``."""
    packed, g, gs, u, us = _kept_operands(kept)
    cols = shape[-1] // 2 if packed else shape[-1]
    h = torch.empty((*shape[:-1], cols), dtype=dtype, device=g.device)
    n = h.numel()
    if n:
        _swiglu_fwd[(cdiv(n, _BLOCK),)](g, u, h, n, cols, gs, us, BLOCK=_BLOCK, GELU=gelu,
                                        PACKED=packed, SCALED=True, num_warps=4)  # fmt: skip
    return h


def _kept_product(gelu: bool, m: Tensor, *kept: Tensor) -> Tensor | None:
    """:func:`_left_product` over gate and up kept in FP8."""
    packed, g, gs, u, us = _kept_operands(kept)
    return _left_product(gelu, m, g, None if packed else u, (gs, us))


def run_fp8_kept(activation: str, gate: Tensor, up: Tensor | None = None) -> Tensor:
    """``activation`` (``"swiglu"`` or ``"geglu"``) on arguments already checked, gate and
    up kept for the backward in FP8 (the routed op's ``fp8`` kernels). A packed pair made
    by a projection over a base stored in FP8 (marked with its gradient's scales,
    :mod:`._infra._fp8_handoff`) hands that projection each row's amax of its gradient,
    and hands ``h``'s per-token cast to the next projection: under ``fp8_base`` every
    LoRA base is stored, so the down projection's FP8 GEMM reads it."""
    inputs = (gate.contiguous(),) if up is None else (gate.contiguous(), up.contiguous())
    scales = gradient_scales(gate) if up is None else None
    cast_h = scales is not None
    h, *rest = _KeptFp8.apply(inputs[0], None if up is None else inputs[1], activation,
                              scales, cast_h)  # fmt: skip
    kept = rest[:-2] if cast_h else rest
    if cast_h:
        hand_cast(h, *rest[-2:])
    gelu, shape, dtype = activation == "geglu", inputs[0].shape, inputs[0].dtype
    mark_recomputable(h, functools.partial(_kept_again, gelu, shape, dtype), *kept,
                      product=functools.partial(_kept_product, gelu))  # fmt: skip
    return h


def run_swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """:func:`swiglu` on arguments already checked (the routed op's call path)."""
    return _run("swiglu", gate, up)


def run_geglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """:func:`geglu` on arguments already checked (the routed op's call path)."""
    return _run("geglu", gate, up)


def check_swiglu(gate: Tensor, up: Tensor | None, op: str = "swiglu") -> None:
    """Raise :class:`~xpuruntime.InvalidInputError` unless ``gate`` and ``up`` are float
    tensors of one shape, dtype and device, or (``up`` None) ``gate`` is a float tensor
    whose last dimension is even (its halves the gate and up)."""
    for name, t in (("gate", gate), ("up", gate if up is None else up)):
        if not isinstance(t, Tensor):
            raise InvalidInputError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if up is None:
        if gate.dim() == 0 or gate.shape[-1] % 2:
            raise InvalidInputError(
                f"{op}: a packed gate and up (up=None) must have an even last dimension "
                f"(the gate, then up), got shape {tuple(gate.shape)}"
            )
    elif gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise InvalidInputError(
            f"{op}: gate and up must match, got {tuple(gate.shape)} {gate.dtype} on "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} on {up.device}"
        )
    if gate.dtype not in FLOAT_DTYPES:
        raise InvalidInputError(f"{op}: expected fp32, fp16 or bf16, got {gate.dtype}")


def swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """``F.silu(gate) * up`` in one Triton pass, forward and backward.

    Parameters
    ----------
    gate, up : Tensor
        The MLP's two projections, the same shape, dtype (fp32, fp16 or bf16) and device.
        ``up`` None: ``gate`` holds both, the gate then up, as the halves of its last
        dimension (one GEMM's output over the concatenated projections).

    Returns
    -------
    Tensor
        ``silu(gate) * up``, in their shape (packed: half the last dimension) and dtype
        (computed in fp32).

    Raises
    ------
    InvalidInputError
        Shapes, dtypes or devices that differ, a dtype other than fp32/fp16/bf16, or a
        packed input whose last dimension is odd.
    UnsupportedOperationError, BackendUnavailableError
        Under a strict kernel policy, where Triton cannot run on the tensors' device;
        otherwise PyTorch's expression runs after a ``FallbackWarning``.

    Examples
    --------
    >>> h = swiglu(gate_proj(x), up_proj(x))                 # doctest: +SKIP
    >>> h = swiglu(gate_up_proj(x))                          # doctest: +SKIP
    """
    check_swiglu(gate, up)
    if not triton_or_fallback("swiglu", gate, gate if up is None else up):
        return torch_swiglu(gate, up)
    return run_swiglu(gate, up)


def geglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` in one Triton pass, forward and
    backward; arguments (``up`` None: packed), results and errors as :func:`swiglu`'s.

    Examples
    --------
    >>> h = geglu(gate_proj(x), up_proj(x))                  # doctest: +SKIP
    """
    check_swiglu(gate, up, "geglu")
    if not triton_or_fallback("geglu", gate, gate if up is None else up):
        return torch_geglu(gate, up)
    return run_geglu(gate, up)

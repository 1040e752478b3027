r"""fp8_linear: a linear layer whose GEMMs (forward, input gradient, and by the
tensorwise recipe the weight gradient) run with FP8 operands through
``torch._scaled_mm`` (Hopper and Ada GPUs).

Each operand is scaled into FP8's range, cast, and the GEMM's fp32 accumulator is
scaled back:

.. math::
    q(t) = \mathrm{fp8}\big(\mathrm{clamp}(t \cdot s_t, \pm m)\big),\quad
    s_t = m / \max(\mathrm{amax}(t), \epsilon),\quad
    x W^T \approx (q(x)\, q(W)^T) / (s_x s_W)

with ``m`` the format's largest value. Two recipes, named as torchao names them:

- ``tensorwise``: one scale per tensor; the input and weight in e4m3, the output
  gradient in e5m2 (its range is wider, its values less even). Each operand is cast
  once, in one pass that also writes the transposed copy the other GEMM reads.
- ``rowwise``: a scale per row along the contraction (one per token for the input, one
  per output feature for the weight), all in e4m3; the input gradient's operands are
  contracted along another dimension, so each is scaled and cast again along it. The
  weight gradient's GEMM stays in the compute dtype (torchao's ``rowwise_with_gw_hp``).
  In e4m3, its output gradient scaled per output feature over every token, it trained
  worse: a Llama-1B-shape model ended 0.7-3.4% above bf16's loss after 500 steps (two
  seeds). With that GEMM in bf16 it ended between -0.1% and +0.9%
  (``benchmarks/fp8_loss_parity.py``).

The amax is one reduction (``torch.linalg.vector_norm(t, inf)``: no copy of ``|t|``);
the scale is computed on the device inside the cast (no wait for the GPU), and the cast
writes the inverse scale the GEMM multiplies back by. A cast per row reduces, scales
and casts in one launch (:func:`_cast_rows`): at 1B sizes the host's calls, not the
GPU's passes, bound an FP8 layer. Tensorwise, the backward keeps the input's
transposed FP8 copy its weight gradient reads (half a bf16 input's bytes), not the
input; rowwise keeps the input. Both keep the weights as given, not a cast or a join of
them: under FSDP2, the gathered weights it frees after the forward. The backward casts
them again, tensorwise by the forward's amax (the same bits), rowwise along the input
gradient's contraction. The output and the gradients are in the
compute dtype.

A weight stored once in FP8 (:class:`._infra._fp8_weight.Fp8Weight`, e4m3 with a scale
per output row) is read as stored by :func:`stored_output_gemm` and
:func:`stored_input_grad_gemm`, whatever the recipe: rowwise GEMMs, the input cast per
token, the weight's scales folded into the output gradient's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import UnsupportedOperationError
from ._infra._cached_launch import cached_launch
from ._infra._constants import constant
from ._infra._first_order import first_order
from ._infra._fp8_gathered import gathered, plain
from ._infra._joined_storage import join_weights
from ._infra._launch import cdiv
from ._infra._native import PlanTable, Replay

__all__ = [
    "RECIPES",
    "cast_constants",
    "fp8_linear",
    "fp8_linear_joined",
    "input_grad_gemm",
    "new_output",
    "output_gemm",
    "quantize",
    "refuse",
    "row_tile",
    "run_linear",
    "scaled_to_grid",
    "stored_input_grad_gemm",
    "stored_output_gemm",
    "transposed",
    "unsupported",
]

RECIPES = ("tensorwise", "rowwise")
"""How the operands are scaled: one scale per tensor, or one per row."""

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12  # the smallest amax a scale divides by (an all-zero tensor casts to zeros)
_TILE = 64
# (rows, columns) a program of _cast_rows takes at once, and its warps: on an H200 the
# fastest of those tried over Llama-8B's activations (4096 rows of 4096 to 28672 columns:
# 24-183 us, 8 x 512 by 4 warps 33-187 us)
_CAST_ROWS = (2, 2048, 8)
_FMAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_GRIDS = {  # each format's mantissa bits, smallest normal and grid below it
    E4M3: {"MANTISSA": 3, "TINY": 2.0**-6, "SPACING": 2.0**-9},
    E5M2: {"MANTISSA": 2, "TINY": 2.0**-14, "SPACING": 2.0**-16},
}


def cast_constants(dtype: torch.dtype) -> dict[str, float]:
    """The constexprs a kernel casting to ``dtype`` (e4m3 or e5m2) with
    :func:`scaled_to_grid` takes: FMAX, MANTISSA, TINY, SPACING and EPS."""
    return {"FMAX": _FMAX[dtype], **_GRIDS[dtype], "EPS": _EPS}


@triton.jit
def _on_grid(q, MANTISSA: tl.constexpr, TINY: tl.constexpr, SPACING: tl.constexpr):
    """``q`` (fp32, in the format's range) rounded to the format's grid (nearest, ties
    to even) by hand, so that the cast after is exact: Triton's interpreter rounds some
    values across a power of two wrongly (-126.5 to -64 in e4m3). Normal values keep
    MANTISSA bits; below the smallest normal the grid is even, and an add and subtract
    of a large constant rounds to it."""
    drop: tl.constexpr = 23 - MANTISSA
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & -(1 << drop)
    magic: tl.constexpr = 1.5 * 2.0**23 * SPACING
    return tl.where(tl.abs(q) < TINY, (q + magic) - magic, bits.to(tl.float32, bitcast=True))


@triton.jit
def scaled_to_grid(v, scale, FMAX: tl.constexpr, MANTISSA: tl.constexpr, TINY: tl.constexpr,
                   SPACING: tl.constexpr):  # fmt: skip
    """``v * scale`` (fp32) clamped to the format's range and rounded to its grid: what
    the cast to the format then writes exactly."""
    top = tl.full((), FMAX, tl.float32)
    return _on_grid(tl.minimum(tl.maximum(v * scale, -top), top), MANTISSA, TINY, SPACING)


@cached_launch
@triton.jit
def _cast(
    src_ptr,  # (R, C), strides (stride_r, stride_c)
    amax_ptr,  # fp32: one (PER == 0), R (PER == 1: per row) or C (PER == 2: per column)
    inverse_ptr,  # fp32, amax's shape: amax / FMAX (written by the first tile of each)
    out_ptr,  # (R, C) row-major, or nothing (ROWS False)
    out_t_ptr,  # (C, R) row-major: the transposed copy, or nothing (COLUMNS False)
    R,
    C,
    stride_r,
    stride_c,
    FMAX: tl.constexpr,
    MANTISSA: tl.constexpr,  # the format's mantissa bits
    TINY: tl.constexpr,  # its smallest normal value
    SPACING: tl.constexpr,  # its grid below that
    EPS: tl.constexpr,
    PER: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    v = tl.load(src_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    # fp32 arithmetic in the interpreter too, and an IEEE division (Triton's ``/`` is an
    # approximate one on the GPU: a scale an ulp off rounds ties the other way).
    top = tl.full((), FMAX, tl.float32)
    eps = tl.full((), EPS, tl.float32)
    if PER == 0:
        amax = tl.maximum(tl.load(amax_ptr), eps)
        scale = tl.math.div_rn(top, amax)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(inverse_ptr, tl.math.div_rn(amax, top))
    elif PER == 1:
        amax = tl.maximum(tl.load(amax_ptr + rows, mask=rows < R, other=1.0), eps)
        scale = tl.math.div_rn(top, amax)[:, None]
        if tl.program_id(1) == 0:
            tl.store(inverse_ptr + rows, tl.math.div_rn(amax, top), mask=rows < R)
    else:
        amax = tl.maximum(tl.load(amax_ptr + cols, mask=cols < C, other=1.0), eps)
        scale = tl.math.div_rn(top, amax)[None, :]
        if tl.program_id(0) == 0:
            tl.store(inverse_ptr + cols, tl.math.div_rn(amax, top), mask=cols < C)
    q = scaled_to_grid(v.to(tl.float32), scale, FMAX, MANTISSA, TINY, SPACING)
    q = q.to(out_ptr.dtype.element_ty)  # (out_ptr is out_t_ptr where ROWS is off)
    if ROWS:
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if COLUMNS:
        tl.store(out_t_ptr + cols[None, :] * R + rows[:, None], q, mask=mask)


@triton.jit
def row_tile(src_ptr, mul_ptr, rows, cols, R, C, stride_r, stride_c, MUL: tl.constexpr):
    """The (rows, cols) tile of ``t`` in fp32 (of ``t diag(mul)`` where MUL), and its
    mask."""
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    v = tl.load(src_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    if MUL:
        v = v * tl.load(mul_ptr + cols, mask=cols < C, other=0.0)[None, :]
    return v, mask


@cached_launch
@triton.jit
def _cast_rows(
    src_ptr,  # (R, C), strides (stride_r, stride_c)
    mul_ptr,  # fp32 (C,): what each column is multiplied by first (MUL), or nothing
    parts_ptr,  # fp32 (R, P) row-major: each row's amax in P parts, given (PARTS), or nothing
    out_ptr,  # (R, C) row-major
    inverse_ptr,  # fp32 (R,): each row's amax / FMAX, what the GEMM multiplies back by
    R,
    C,
    P,
    stride_r,
    stride_c,
    FMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    TINY: tl.constexpr,
    SPACING: tl.constexpr,
    EPS: tl.constexpr,
    MUL: tl.constexpr,
    PARTS: tl.constexpr,  # 0, or a power of two >= P
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """:func:`_cast` per row in one launch: each row's amax (of ``t diag(mul)`` where
    MUL; where PARTS, the largest of the parts its maker found), its inverse scale, and
    the cast, the rows read twice by one program (once where PARTS)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if PARTS:
        parts = tl.arange(0, PARTS)
        at = parts_ptr + rows[:, None] * P + parts[None, :]
        given = tl.load(at, mask=(rows[:, None] < R) & (parts[None, :] < P), other=0.0)
        acc = tl.max(given, axis=1)
    else:
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for start in range(0, C, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            v, _ = row_tile(src_ptr, mul_ptr, rows, cols, R, C, stride_r, stride_c, MUL)
            acc = tl.maximum(acc, tl.max(tl.abs(v), axis=1))
    top = tl.full((), FMAX, tl.float32)
    amax = tl.maximum(acc, tl.full((), EPS, tl.float32))
    tl.store(inverse_ptr + rows, tl.math.div_rn(amax, top), mask=rows < R)
    scale = tl.math.div_rn(top, amax)[:, None]
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        v, mask = row_tile(src_ptr, mul_ptr, rows, cols, R, C, stride_r, stride_c, MUL)
        q = scaled_to_grid(v, scale, FMAX, MANTISSA, TINY, SPACING)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], q.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


@cached_launch
@triton.jit
def _transpose(src_ptr, out_ptr, R, C, TILE: tl.constexpr):
    """``out`` (C, R) row-major = ``src`` (R, C) row-major transposed, a tile a program."""
    rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    v = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=mask)
    tl.store(out_ptr + cols[:, None] * R + rows[None, :], tl.trans(v), mask=tl.trans(mask))


def transposed(t: Tensor) -> Tensor:
    """A row-major (R, C) tensor's (C, R) row-major transpose, by one Triton launch (on
    CUDA from C++ from a call signature's second call on: :func:`_replayed`)."""
    out = _replayed("transpose", _transpose_reference, t, None, None, t.dtype)
    if out is None:
        return _transposed_launched(t)
    return out


def _transposed_launched(t: Tensor) -> Tensor:
    r, c = t.shape
    out = torch.empty((c, r), dtype=t.dtype, device=t.device)
    if t.numel():
        _transpose[(cdiv(r, _TILE), cdiv(c, _TILE))](t, out, r, c, TILE=_TILE)
    return out


def _transpose_reference(tensors, scalar, out_dtype):
    return _transposed_launched(tensors[0])


_compiling = torch.compiler.is_compiling


def _replayed(
    name: str, reference, t: Tensor, second: Tensor | None, third: Tensor | None, dtype
) -> Tensor | tuple[Tensor, ...] | None:
    """``reference``'s launches (allocations and one launch) replayed from C++
    (:mod:`._infra._native`: a few us of host time, against about 25 from Python), or
    None where no plan takes the call (the first of its signature, a capture, another
    layout; a tensor not plain CUDA, empty or traced). Keyed on the shapes and dtypes
    the launchers read."""
    if t.__class__ is not Tensor or not t.is_cuda or not t.numel() or _compiling():
        return None
    key = (
        name, reference, t.shape, t.dtype, dtype, t.get_device(),
        None if second is None else (second.shape, second.dtype),
        None if third is None else (third.shape, third.dtype),
    )  # fmt: skip
    return _plans.get(key).call(t, second, third, None, 0.0, dtype)


_plans = PlanTable(lambda key: Replay(f"xpuruntime::fp8_{key[0]}", key[1], False))


def quantize(
    t: Tensor,
    dtype: torch.dtype,
    per: str,
    *,
    rows: bool = True,
    columns: bool = False,
    multiplier: Tensor | None = None,
    amax: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """A 2-D tensor scaled and cast to ``dtype`` (e4m3 or e5m2).

    Parameters
    ----------
    t : Tensor
        (R, C), any strides, a float dtype.
    dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    per : {'tensor', 'row', 'column'}
        One scale, one per row or one per column.
    rows, columns : bool
        Write the (R, C) row-major cast, its (C, R) row-major transpose, or both.
    multiplier : Tensor, optional
        fp32 (C,): each column multiplied by its value before the cast (``per='row'``
        with ``rows`` alone): ``t diag(multiplier)`` is what is scaled and cast.
    amax : Tensor, optional
        The amax to scale by, not one found here: fp32 0-dim (``per='tensor'``: an
        earlier cast's, to write the same bits again), or fp32 (R, P) (``per='row'``
        with ``rows`` alone: each row's of ``t diag(multiplier)`` in P parts, as
        ``t``'s maker found them; a smaller one clamps the row).

    Returns
    -------
    tuple
        ``(cast or None, transposed or None, inverse scale)``: the inverse scale fp32,
        shaped () per tensor, (R, 1) per row, (1, C) per column, what ``_scaled_mm``
        multiplies its accumulator by.
    """
    r, c = t.shape
    if per == "row" and rows and not columns:
        return _rows_cast(t, dtype, multiplier, amax)
    if per == "tensor":
        if amax is None:
            amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
        code = 0
    else:
        dim = 1 if per == "row" else 0
        amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, dtype=torch.float32)
        code = 1 if per == "row" else 2
    out = torch.empty((r, c), dtype=dtype, device=t.device) if rows else None
    out_t = torch.empty((c, r), dtype=dtype, device=t.device) if columns else None
    if not t.numel():  # (no tile to write the inverse: an amax of nothing is 0)
        inverse = amax.clamp(min=_EPS) / _FMAX[dtype]
    else:
        inverse = torch.empty_like(amax)
        _cast[(cdiv(r, _TILE), cdiv(c, _TILE))](
            t, amax, inverse, out if rows else out_t, out_t if columns else out, r, c,
            t.stride(0), t.stride(1), FMAX=_FMAX[dtype], **_GRIDS[dtype], EPS=_EPS, PER=code,
            ROWS=rows, COLUMNS=columns, TILE=_TILE,
        )  # fmt: skip
    if per == "row":
        inverse = inverse[:, None]
    elif per == "column":
        inverse = inverse[None, :]
    return out, out_t, inverse


def _rows_cast(
    t: Tensor, dtype: torch.dtype, multiplier: Tensor | None, parts: Tensor | None
) -> tuple[Tensor, None, Tensor]:
    """:func:`quantize` per row, rows only: the amax (or the largest of its ``parts``,
    fp32 (R, P)), the cast and the inverse scale in one launch (five host calls fewer
    than a reduction, a cast and the scale's arithmetic, on a path every FP8 GEMM over a
    stored weight takes twice a layer); on CUDA from C++ from a call signature's second
    call on (:func:`_replayed`)."""
    out = _replayed("cast_rows", _cast_reference, t, multiplier, parts, dtype)
    if out is None:
        return _rows_cast_launched(t, dtype, multiplier, parts)
    return out[0], None, out[1]


def _rows_cast_launched(
    t: Tensor, dtype: torch.dtype, multiplier: Tensor | None, parts: Tensor | None
) -> tuple[Tensor, None, Tensor]:
    r, c = t.shape
    out = torch.empty((r, c), dtype=dtype, device=t.device)
    inverse = torch.empty((r, 1), dtype=torch.float32, device=t.device)
    p = 0 if parts is None else parts.shape[1]
    if r:
        _cast_rows[(cdiv(r, _CAST_ROWS[0]),)](
            t, t if multiplier is None else multiplier, inverse if parts is None else parts,
            out, inverse, r, c, p, t.stride(0), t.stride(1), **cast_constants(dtype),
            MUL=multiplier is not None, PARTS=p and 1 << (p - 1).bit_length(),
            BLOCK_R=_CAST_ROWS[0], BLOCK_C=_CAST_ROWS[1], num_warps=_CAST_ROWS[2],
        )  # fmt: skip
    return out, None, inverse


def _cast_reference(tensors, scalar, out_dtype):
    return _rows_cast_launched(tensors[0], out_dtype, tensors[1], tensors[2])[::2]


def unsupported(rows: int, in_features: int, out_features: int) -> str | None:
    """Why ``torch._scaled_mm`` cannot take a layer's GEMMs at this shape (None: it can):
    every dimension a GEMM contracts or writes must divide by 16."""
    odd = [f"{name} {n}" for name, n in (("tokens", rows), ("in_features", in_features),
           ("out_features", out_features)) if n % 16]  # fmt: skip
    if odd:
        return f"FP8 GEMMs need every dimension divisible by 16 ({', '.join(odd)})"
    return None


def refuse(caller: str, x: Tensor, out_features: int, recipe: str) -> None:
    """Raise :class:`UnsupportedOperationError`, naming ``caller``, for an unknown
    recipe or a GEMM shape ``torch._scaled_mm`` does not take (:func:`unsupported`)."""
    if recipe not in RECIPES:
        raise UnsupportedOperationError(f"{caller}: recipe {recipe!r}; one of {RECIPES}")
    rows = x.numel() // max(1, x.shape[-1])
    why = unsupported(rows, x.shape[-1], out_features)
    if why is not None:
        raise UnsupportedOperationError(f"{caller}: {why}")


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs in FP8.

    Parameters
    ----------
    x : Tensor
        (..., in_features), in the compute dtype (bf16 or fp16).
    weight : Tensor
        (out_features, in_features), any float dtype (cast to ``x``'s for its casts).
    bias : Tensor, optional
        (out_features,).
    recipe : {'tensorwise', 'rowwise'}
        How the operands are scaled (see the module's text).

    Returns
    -------
    Tensor
        (..., out_features) in ``x``'s dtype.

    Raises
    ------
    UnsupportedOperationError
        An unknown recipe, or a shape ``torch._scaled_mm`` does not take.
    """
    refuse("fp8_linear", x, weight.shape[0], recipe)
    out = _Fp8Linear.apply(x, recipe, weight)
    return out if bias is None else out + bias


def fp8_linear_joined(x: Tensor, weights: tuple[Tensor, ...], recipe: str) -> Tensor:
    """:func:`fp8_linear` over ``weights`` joined by rows (one GEMM each way), no
    bias; each weight's gradient is its rows of the joined one's."""
    refuse("fp8_linear", x, sum(w.shape[0] for w in weights), recipe)
    return _Fp8Linear.apply(x, recipe, *weights)


def run_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> Tensor:
    """:func:`fp8_linear` as ``F.linear`` under autocast runs a layer: the input, weight
    and bias in autocast's dtype where it is on (else the input's)."""
    from ._infra._launch import autocast_dtype

    compute = autocast_dtype(x.device.type) or x.dtype
    with torch.autocast(x.device.type, enabled=False):
        bias = None if bias is None else bias.to(compute)
        return fp8_linear(x.to(compute), weight, bias, recipe)


def _mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """``a @ b`` rescaled: ``a`` row-major, ``b`` column-major (a row-major tensor's
    ``.t()``), as ``torch._scaled_mm`` takes them; written into ``out`` where given."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=dtype, out=out)


def new_output(x: Tensor, out_features: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A new (..., out_features) output for an input of ``x``'s leading dimensions, and
    its (tokens, out_features) rows the GEMM writes. Made so, not as a view of the GEMM's
    2-D result, so that halves split from it are views of a tensor of their own shape
    (:func:`.._functional._projections.joined_halves`: a gated MLP's gate and up are
    then taken whole, not copied)."""
    out = torch.empty((*x.shape[:-1], out_features), dtype=dtype, device=x.device)
    return out, out.view(-1, out_features)


def output_gemm(x: Tensor, weight: Tensor, recipe: str, out: Tensor | None = None) -> Tensor:
    """``x W^T`` over (tokens, in) rows with FP8 operands, in ``x``'s dtype (into
    ``out`` where given): the forward GEMM of ``recipe`` (both operands e4m3, scaled per
    tensor or per row)."""
    per = "tensor" if recipe == "tensorwise" else "row"
    xq, _, sx = quantize(x, E4M3, per)
    wq, _, sw = quantize(weight, E4M3, per)
    return _mm(xq, wq.t(), sx, sw if per == "tensor" else sw.reshape(1, -1), x.dtype, out)


def input_grad_gemm(dy: Tensor, weight: Tensor, recipe: str) -> Tensor:
    """``dY W`` over (tokens, out) rows with FP8 operands, in ``dy``'s dtype: the input
    gradient's GEMM of ``recipe`` (tensorwise: dY e5m2; rowwise: both e4m3, scaled
    along the contraction), the weight cast again in the transposed layout it needs."""
    if recipe == "tensorwise":
        dq, _, sd = quantize(dy, E5M2, "tensor")
        _, wt, sw = quantize(weight, E4M3, "tensor", rows=False, columns=True)
    else:
        dq, _, sd = quantize(dy, E4M3, "row")
        _, wt, sw = quantize(weight, E4M3, "column", rows=False, columns=True)
    return _mm(dq, wt.t(), sd, sw, dy.dtype)


def stored_output_gemm(
    x: Tensor,
    qdata: Tensor,
    scale: Tensor,
    out: Tensor | None = None,
    cast: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``x W^T`` over (tokens, in) rows for a weight stored in e4m3 with a scale per
    output row (:class:`._infra._fp8_weight.Fp8Weight`: ``W = diag(scale) qdata``), in
    ``x``'s dtype (into ``out`` where given): ``x`` cast per token (``cast``: that cast,
    ``(qdata, inverse)``, as ``x``'s maker made it), ``qdata`` read as stored."""
    xq, sx = cast if cast is not None else quantize(x, E4M3, "row")[::2]
    return _mm(xq, qdata.t(), sx, scale.view(1, -1), x.dtype, out)


def stored_input_grad_gemm(
    dy: Tensor,
    qdata: Tensor | None,
    scale: Tensor,
    amax: Tensor | None = None,
    columns: Tensor | None = None,
) -> Tensor:
    """``dY W`` over (tokens, out) rows for a stored weight (:func:`stored_output_gemm`),
    in ``dy``'s dtype: ``(dY diag(scale)) qdata``, the scales folded into ``dY``'s cast
    per token (e4m3; ``amax``: each row's of ``dY diag(scale)`` in parts, as ``dY``'s
    maker found them), ``qdata`` transposed to the layout the GEMM reads (one byte read
    and written per weight; no second stored copy), or ``columns``, that transpose
    (in, out) row-major, where the caller made it so (then ``qdata`` is not read)."""
    dq, _, sd = quantize(dy.contiguous(), E4M3, "row", multiplier=scale, amax=amax)
    if columns is None:
        columns = transposed(qdata)
    k, device = columns.shape[0], dy.device
    ones = constant(("ones", k, device), device, lambda: torch.ones((1, k), device=device))
    return _mm(dq, columns.t(), sd, ones, dy.dtype)


class _Fp8Linear(torch.autograd.Function):
    """``x W^T`` over the last dimension of ``x`` (..., in), ``W`` the weights joined by
    rows in ``x``'s dtype, its GEMMs in FP8 over (tokens, in) rows (rowwise, the weight
    gradient's in the compute dtype). The backward keeps the weights as given, not a
    cast or a join of them: under FSDP2 they are the gathered ones, which it frees after
    the forward and gathers again for the backward. The backward joins and casts them
    again (tensorwise, by the forward's amax: the same bits)."""

    @staticmethod
    def forward(ctx, x, recipe, *weights):
        dtype, shape = x.dtype, x.shape
        fp8 = gathered(weights) if recipe == "tensorwise" else None
        out, rows_out = new_output(x, sum(w.shape[0] for w in weights), dtype)
        x = x.reshape(-1, shape[-1])
        if recipe == "tensorwise":
            # One cast of x, with the transposed copy the weight gradient reads.
            xq, xt, sx = quantize(x, E4M3, "tensor", columns=True)
            if fp8 is not None:  # gathered in FP8 by FSDP2: cast on each rank before it
                (wq, sw), amax = fp8, None
            else:
                weight = join_weights(plain(weights), dtype)
                amax = torch.linalg.vector_norm(weight, float("inf"), dtype=torch.float32)
                wq, _, sw = quantize(weight, E4M3, "tensor", amax=amax)
            _mm(xq, wq.t(), sx, sw, dtype, rows_out)
            ctx.save_for_backward(xt, sx, amax, *weights)
        else:
            output_gemm(x, join_weights(plain(weights), dtype), recipe, rows_out)
            ctx.save_for_backward(x, *weights)
        ctx.recipe, ctx.shape, ctx.sizes = recipe, shape, [w.shape[0] for w in weights]
        return out

    @staticmethod
    @first_order("fp8_linear")
    def backward(ctx, dy):
        dy = dy.reshape(-1, dy.shape[-1]).contiguous()
        dtype = dy.dtype
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        dx = dw = None
        if ctx.recipe == "tensorwise":
            xt, sx, amax, *weights = ctx.saved_tensors
            dq, dqt, sd = quantize(dy, E5M2, "tensor", rows=need_x, columns=need_w)
            if need_x:  # dY (tokens, out) @ W (out, in): W's transpose, row-major
                fp8 = gathered(tuple(weights))
                if fp8 is not None:  # gathered again for the backward, by the same amax
                    wt, sw = transposed(fp8[0]), fp8[1]
                else:
                    weight = join_weights(plain(tuple(weights)), dtype)
                    _, wt, sw = quantize(weight, E4M3, "tensor", rows=False, columns=True,
                                         amax=amax)  # fmt: skip
                dx = _mm(dq, wt.t(), sd, sw, dtype)
            if need_w:  # dY^T (out, tokens) @ X (tokens, in): X's transpose, row-major
                dw = _mm(dqt, xt.t(), sd, sx, dtype)
        else:
            x, *weights = ctx.saved_tensors
            if need_x:
                dx = input_grad_gemm(dy, join_weights(plain(tuple(weights)), dtype), "rowwise")
            if need_w:  # in the compute dtype (see the module's text)
                dw = dy.t() @ x
        dws = [None] * len(weights) if dw is None else [
            g.to(w.dtype) for g, w in zip(dw.split(ctx.sizes), weights)]  # fmt: skip
        return None if dx is None else dx.view(ctx.shape), None, *dws

r"""fused_layernorm: layer normalisation over the last dimensions, in Triton.

.. math::
    \mu = \tfrac{1}{N}\sum_j x_j,\quad
    \sigma^2 = \tfrac{1}{N}\sum_j (x_j - \mu)^2,\quad
    \hat{x} = (x - \mu)\,r,\quad r = (\sigma^2 + \epsilon)^{-1/2},\quad
    y = \hat{x}\,w + b

Backward, with :math:`g = w \odot \partial y`:

.. math::
    \partial x = r\left(g - \hat{x}\,\overline{g \hat{x}} - \overline{g}\right),\quad
    \partial w = \sum_{\text{rows}} \partial y \odot \hat{x},\quad
    \partial b = \sum_{\text{rows}} \partial y

(bars are means over the row). Ba, Kiros & Hinton, "Layer Normalization" (2016,
arXiv:1607.06450); the kernels follow the Triton layer-norm tutorial and Liger-Kernel.

Every row is read once in the forward (one program per row; rows wider than
``MAX_ROW_BLOCK`` are walked in chunks) and the statistics (mean, 1/std) are kept in
fp32 for the backward. The backward is persistent: a few programs per SM walk blocks of
rows, keep their partial weight and bias gradients in registers, and write one fp32 row
each, summed at the end, instead of atomics or a second pass over the activations.
Accumulation is fp32 for every input dtype.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from ..._errors import UnsupportedOperationError
from ._infra._cached_launch import cached_launch
from ._infra._launch import (
    MAX_ROW_BLOCK,
    backward_launch,
    cast,
    cdiv,
    row_groups,
    row_launch,
    rows_at_once,
    triton_or_fallback,
)
from ._infra._native import PlanTable, Replay, replayed_call
from ._infra._op import kernel_op
from ._infra._partials import sum_rows
from ._infra._rows import (
    check_norm_args,
    normalized,
    output_dtype,
    param_row,
    params_grad_dtype,
    trained_dtypes,
)

__all__ = ["fused_layernorm", "replay_layernorm", "run_layernorm"]


# -- kernels ---------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _layernorm_fwd(
    x_ptr,  # (M, N) input, unit stride along N
    r_ptr,  # (M, N) residual added to x first, x's row stride (read when HAS_RESIDUAL)
    h_ptr,  # (M, N) the sum x + r, x's row stride (written when HAS_RESIDUAL)
    y_ptr,  # (M, N) output
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    b_ptr,  # (N,) bias (read when HAS_BIAS)
    mean_ptr,  # (M,) fp32 row means
    rstd_ptr,  # (M,) fp32 row 1/std
    x_row_stride,
    y_row_stride,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STATS: tl.constexpr,  # whether the statistics are written (for a backward)
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum in fp32, rounded once to h's dtype; the norm reads it as stored, as
        # an add followed by a norm does.
        r = tl.load(r_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * x_row_stride + cols, h, mask=mask)
        x = h.to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@cached_launch
@triton.jit
def _layernorm_fwd_looped(
    x_ptr,  # (M, N) input, unit stride along N
    y_ptr,  # (M, N) output
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    b_ptr,  # (N,) bias (read when HAS_BIAS)
    mean_ptr,  # (M,) fp32 row means
    rstd_ptr,  # (M,) fp32 row 1/std
    x_row_stride,
    y_row_stride,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STATS: tl.constexpr,  # whether the statistics are written (for a backward)
    BLOCK_N: tl.constexpr,
):
    # Rows too wide for registers: one pass for the mean, one for the variance (two
    # passes, not sum/sum-of-squares, which cancels catastrophically), one to write.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        acc += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@cached_launch
@triton.jit
def _layernorm_bwd(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    mean_ptr,  # (M,) fp32 from the forward
    rstd_ptr,  # (M,) fp32 from the forward
    dx_ptr,  # (M, N) input gradient
    dres_ptr,  # (M, N) gradient added to dx, dx's row stride (read when HAS_DRES)
    dx2_ptr,  # (M, N) second copy of dx in its own dtype, dx's row stride (SECOND_DX)
    dw_ptr,  # (P, N) fp32 partial weight gradients, one row per program (WEIGHT_GRAD)
    db_ptr,  # (P, N) fp32 partial bias gradients, one row per program (BIAS_GRAD)
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    M,
    N,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,  # the weight's gradient wanted (not for a frozen one)
    BIAS_GRAD: tl.constexpr,  # the bias's gradient wanted (a bias that trains)
    HAS_DRES: tl.constexpr,
    SECOND_DX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows taken at once (narrow rows: several per step)
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for r in range(first, last, BLOCK_M):
        rows = (r + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < last
        tile = row_mask[:, None] & mask[None, :]
        at = rows[:, None] * x_row_stride + cols[None, :]
        x = tl.load(x_ptr + at, mask=tile, other=0.0).to(tl.float32)
        at = rows[:, None] * dy_row_stride + cols[None, :]
        dy = tl.load(dy_ptr + at, mask=tile, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        xhat = tl.where(tile, (x - mean) * rstd, 0.0)
        g = dy * w[None, :] if HAS_WEIGHT else dy
        c1 = tl.sum(xhat * g, axis=1)[:, None] / N
        c2 = tl.sum(g, axis=1)[:, None] / N
        dx = (g - (xhat * c1 + c2)) * rstd
        dx_offsets = rows[:, None] * dx_row_stride + cols[None, :]
        if HAS_DRES:
            dx += tl.load(dres_ptr + dx_offsets, mask=tile, other=0.0).to(tl.float32)
        tl.store(dx_ptr + dx_offsets, dx.to(dx_ptr.dtype.element_ty), mask=tile)
        if SECOND_DX:
            tl.store(dx2_ptr + dx_offsets, dx.to(dx2_ptr.dtype.element_ty), mask=tile)
        if WEIGHT_GRAD:
            dw += tl.sum(dy * xhat, axis=0)
        if BIAS_GRAD:
            db += tl.sum(dy, axis=0)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + pid * N + cols, dw, mask=mask)
    if BIAS_GRAD:
        tl.store(db_ptr + pid * N + cols, db, mask=mask)


@cached_launch
@triton.jit
def _layernorm_bwd_looped(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    mean_ptr,  # (M,) fp32 from the forward
    rstd_ptr,  # (M,) fp32 from the forward
    dx_ptr,  # (M, N) input gradient
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    N,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Wide rows: the input gradient only, one row per program in two passes; the weight
    # and bias gradients come from _layernorm_bwd_params.
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc1 += tl.where(mask, (x - mean) * rstd, 0.0) * dy
        acc2 += dy
    c1 = tl.sum(acc1, axis=0) / N
    c2 = tl.sum(acc2, axis=0) / N
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dx = (dy - ((x - mean) * rstd * c1 + c2)) * rstd
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _layernorm_bwd_params(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    mean_ptr,  # (M,) fp32 from the forward
    rstd_ptr,  # (M,) fp32 from the forward
    dw_ptr,  # (P, N) fp32 partial weight gradients, one row per row-group
    db_ptr,  # (P, N) fp32 partial bias gradients, one row per row-group
    dy_row_stride,
    x_row_stride,
    M,
    N,
    rows_per_program,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Wide rows: a (column block, row group) grid sums dy * xhat and dy down the rows.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for r in range(first, last):
        row = tl.cast(r, tl.int64)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHT_GRAD:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dw += dy * (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row)
        if BIAS_GRAD:
            db += dy
    if WEIGHT_GRAD:
        tl.store(dw_ptr + group * N + cols, dw, mask=mask)
    if BIAS_GRAD:
        tl.store(db_ptr + group * N + cols, db, mask=mask)


# -- launchers -------------------------------------------------------------------------------
def layernorm_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    y: Tensor,
    mean: Tensor | None,
    rstd: Tensor | None,
    residual: Tensor | None = None,
    total: Tensor | None = None,
) -> None:
    """Write the forward of ``x`` (M, N) into ``y`` (M, N), ``mean`` and ``rstd`` (M,;
    None for both: a forward without a backward, which skips writing them).

    With ``residual`` (and ``total``, laid out as ``x``; rows of at most
    :data:`MAX_ROW_BLOCK`), ``x + residual`` is written into ``total`` and normalised.
    """
    m, n = x.shape
    if m == 0:
        return
    has_residual = residual is not None
    block, warps, looped = row_launch(n, (total if has_residual else x).element_size())
    w, b = x if weight is None else weight, x if bias is None else bias
    stats = mean is not None
    mean, rstd = (mean, rstd) if stats else (y, y)
    flags = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None, "STATS": stats}
    flags["BLOCK_N"] = block
    if looped:
        if has_residual:
            raise UnsupportedOperationError(
                f"layernorm_forward: a residual needs rows of at most {MAX_ROW_BLOCK}, got {n}"
            )
        _layernorm_fwd_looped[(m,)](
            x, y, w, b, mean, rstd, x.stride(0), y.stride(0), n, eps, **flags, num_warps=warps
        )
        return
    _layernorm_fwd[(m,)](
        x, residual if has_residual else x, total if has_residual else x, y, w, b, mean, rstd,
        x.stride(0), y.stride(0), n, eps, **flags, HAS_RESIDUAL=has_residual,
        num_warps=warps,
    )  # fmt: skip


def layernorm_backward(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    dx: Tensor,
    bias_grad: bool,
    dres: Tensor | None = None,
    dx2: Tensor | None = None,
    grad_dtype: torch.dtype = torch.float32,
    weight_grad: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Write the input gradient into ``dx``; return the weight and bias gradients, summed
    in fp32 and written in ``grad_dtype``. Each is None where it is not wanted: no
    weight, or ``weight_grad`` False; ``bias_grad`` False (no bias, or a frozen one).

    ``dres`` (laid out as ``dx``): a gradient added to the input gradient; ``dx2``: a
    second copy of it in ``dx2``'s dtype (rows of at most :data:`MAX_ROW_BLOCK` for
    either). A residual add's backward, fused.
    """
    m, n = x.shape
    has_weight = weight is not None
    summed = has_weight and weight_grad
    if m == 0:
        zeros = x.new_zeros(n, dtype=grad_dtype)
        return (zeros if summed else None), (zeros.clone() if bias_grad else None)
    block, warps, looped = row_launch(n, x.element_size())
    if looped and (dres is not None or dx2 is not None):
        raise UnsupportedOperationError(
            f"layernorm_backward: dres and dx2 need rows of at most {MAX_ROW_BLOCK}, got {n}"
        )
    if not looped:
        warps, per_sm = backward_launch(block, x.element_size())
        programs, per_program = row_groups(x.device, m, per_sm)
        # One buffer of partial sums for both parameters: one allocation, one summing launch
        # (none where neither is summed: the kernel then writes none, and any pointer will do).
        rows_of = (rstd, rstd)
        if summed or bias_grad:
            partials = torch.empty((2, programs, n), device=x.device, dtype=torch.float32)
            rows_of = (partials, partials[1])
        _layernorm_bwd[(programs,)](
            dy, x, x if weight is None else weight, mean, rstd, dx,
            dx if dres is None else dres, dx if dx2 is None else dx2, *rows_of,
            dy.stride(0), x.stride(0), dx.stride(0), m, n, per_program,
            HAS_WEIGHT=has_weight, WEIGHT_GRAD=summed, BIAS_GRAD=bias_grad,
            HAS_DRES=dres is not None, SECOND_DX=dx2 is not None, BLOCK_N=block,
            BLOCK_M=rows_at_once(block), num_warps=warps,
        )  # fmt: skip
    else:
        _layernorm_bwd_looped[(m,)](
            dy, x, x if weight is None else weight, mean, rstd, dx,
            dy.stride(0), x.stride(0), dx.stride(0), n,
            HAS_WEIGHT=has_weight, BLOCK_N=block, num_warps=warps,
        )  # fmt: skip
        groups, per_group = row_groups(x.device, m, per_sm=4)
        if summed or bias_grad:
            partials = torch.empty((2, groups, n), device=x.device, dtype=torch.float32)
            _layernorm_bwd_params[(cdiv(n, block), groups)](
                dy, x, mean, rstd, partials, partials[1], dy.stride(0), x.stride(0), m, n,
                per_group, WEIGHT_GRAD=summed, BIAS_GRAD=bias_grad, BLOCK_N=block,
                num_warps=warps,
            )  # fmt: skip
    if summed and bias_grad:
        sums = sum_rows(partials, grad_dtype)
        return sums[0], sums[1]
    if summed:
        return sum_rows(partials[0], grad_dtype), None
    return None, (sum_rows(partials[1], grad_dtype) if bias_grad else None)


# -- the op: the registered torch op and the eager Function, from one definition ----------------
def _forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    y = torch.empty_like(x, dtype=out_dtype)
    mean = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    rstd = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    layernorm_forward(x, weight, bias, eps, y, mean, rstd)
    return y, mean, rstd


def _forward_alone(x, weight, bias, eps, out_dtype) -> tuple[Tensor]:
    y = torch.empty_like(x, dtype=out_dtype)
    layernorm_forward(x, weight, bias, eps, y, None, None)  # no statistics to keep
    return (y,)


def _forward_fake(x, weight, bias, eps, out_dtype):
    stats = x.new_empty(x.shape[0], dtype=torch.float32)
    return torch.empty_like(x, dtype=out_dtype), stats, torch.empty_like(stats)


def _backward(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    bias_grad: bool,
    grad_dtype: torch.dtype,
    weight_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(∂x, ∂weight, ∂bias); a parameter's gradient empty where it is not wanted
    (``weight_grad``, ``bias_grad``: a parameter that trains)."""
    dx = torch.empty_like(x)
    dw, db = layernorm_backward(
        dy, x, weight, mean, rstd, dx, bias_grad, grad_dtype=grad_dtype, weight_grad=weight_grad
    )
    # Absent gradients come back as empty tensors (an op returns tensors).
    if dw is None:
        dw = x.new_empty(0, dtype=grad_dtype)
    if db is None:
        db = x.new_empty(0, dtype=grad_dtype)
    return dx, dw, db


def _backward_fake(dy, x, weight, mean, rstd, bias_grad, grad_dtype, weight_grad):
    n = x.shape[1]
    dw = x.new_empty(n if weight is not None and weight_grad else 0, dtype=grad_dtype)
    db = x.new_empty(n if bias_grad else 0, dtype=grad_dtype)
    return torch.empty_like(x), dw, db


def _save(inputs, outputs):
    x, weight, bias = inputs[:3]
    dtypes = trained_dtypes(weight, bias)
    return (x, weight, outputs[1], outputs[2]), (dtypes, params_grad_dtype(*dtypes))


def _prepare(saved, state, dy):
    x, weight, mean, rstd = saved
    (w_dtype, b_dtype), grad_dtype = state
    bias_grad, weight_grad = b_dtype is not None, w_dtype is not None
    return dy.contiguous(), x, weight, mean, rstd, bias_grad, grad_dtype, weight_grad


def _finish(state, grads):
    dx, dw, db = grads
    w_dtype, b_dtype = state[0]
    return (
        dx,
        None if w_dtype is None else cast(dw, w_dtype),
        None if b_dtype is None else cast(db, b_dtype),
        None,
        None,
    )


_layer_norm = kernel_op(
    "layer_norm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    prepare=_prepare,
    finish=_finish,
    alone=_forward_alone,
)


# -- the public entry ------------------------------------------------------------------------
def fused_layernorm(
    input: Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims, in Triton.

    Same contract as ``torch.nn.functional.layer_norm``; forward and backward run our
    kernels (fp32 accumulation) on CUDA devices, or on the CPU under
    ``TRITON_INTERPRET=1``. Works under ``torch.compile`` and CUDA-graph capture (it is
    the registered op ``torch.ops.xpuruntime.layer_norm``).

    Parameters
    ----------
    input : Tensor (..., *normalized_shape)
        fp32, fp16 or bf16; any leading shape.
    normalized_shape : int or sequence of int
        The trailing dims normalised over (their product may be up to at least 65536;
        rows wider than 16384 elements take a chunked path).
    weight, bias : Tensor of shape ``normalized_shape``, optional
        The affine parameters (any float dtype; gradients come back in it).
    eps : float
        Added to the variance.
    out_dtype : torch.dtype, optional
        The output's float dtype (default: ``input``'s). The kernels compute in fp32
        whatever the dtypes, so a bf16 output of an fp32 input is the fp32 result rounded
        once; the input gradient comes back in ``input``'s dtype.

    Returns
    -------
    Tensor
        Same shape as ``input``, in ``out_dtype``.

    Raises
    ------
    InvalidInputError
        A shape, dtype or device that does not match.
    UnsupportedOperationError, BackendUnavailableError
        Under a strict kernel policy: the tensors are not on a device Triton runs on,
        or Triton is missing. Otherwise ``F.layer_norm`` runs, after a
        ``FallbackWarning``.

    Examples
    --------
    >>> y = fused_layernorm(x, x.shape[-1:], w, b)        # doctest: +SKIP
    """
    planned = replayed_call(
        _public_plans, input, None, normalized_shape, eps, out_dtype, weight, bias
    )
    if planned is not None:  # a call of a key checked before, replayed from C++
        return planned
    shape = normalized(normalized_shape)
    check_norm_args("fused_layernorm", input, shape, (("weight", weight), ("bias", bias)))
    out_dtype = output_dtype("fused_layernorm", input, out_dtype)
    tensors = (input, *(t for t in (weight, bias) if t is not None))
    if not triton_or_fallback("fused_layernorm", *tensors):
        return nn.functional.layer_norm(input, shape, weight, bias, float(eps)).to(out_dtype)
    planned = replayed_call(
        _public_plans, input, None, shape, eps, out_dtype, weight, bias, checked=True
    )  # a key's second call derives its plan
    if planned is not None:
        return planned
    return run_layernorm(input, math.prod(shape), weight, bias, float(eps), out_dtype)


def run_layernorm(
    input: Tensor,
    n: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """:func:`fused_layernorm` of arguments already validated, normalising over the
    last dims of ``n`` elements (the call path of the routed op, which validates a call
    signature once)."""
    w, b = param_row(weight, n), param_row(bias, n)
    return _layer_norm.on_rows(n, 1, input, w, b, eps, out_dtype)


_public_plans = PlanTable(lambda key: replay_layernorm(math.prod(key[1])))


def replay_layernorm(n: int) -> Replay:
    """The launch plan (:mod:`._infra._native`) of one call signature of
    :func:`run_layernorm`: ``replay.call(input, weight, bias, None, eps, out_dtype)``."""

    def reference(t, eps, out_dtype):
        w, b = param_row(t[1], n), param_row(t[2], n)
        return _layer_norm.function.apply(n, 1, t[0], w, b, eps, out_dtype)

    return Replay("xpuruntime::layer_norm", reference)

r"""fused_rmsnorm: root-mean-square normalisation over the last dimensions, in Triton.

.. math::
    r = \left(\tfrac{1}{N}\sum_j x_j^2 + \epsilon\right)^{-1/2},\quad
    \hat{x} = x\,r,\quad y = \hat{x}\,w

Backward, with :math:`g = w \odot \partial y`:

.. math::
    \partial x = r\left(g - \hat{x}\,\overline{g \hat{x}}\right),\quad
    \partial w = \sum_{\text{rows}} \partial y \odot \hat{x}

Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019, arXiv:1910.07467). The
same structure as :mod:`.fused_layernorm`: one program per row in the forward (a chunked
path for rows wider than ``MAX_ROW_BLOCK``), 1/rms kept in fp32, and a persistent
backward whose programs keep partial weight gradients in registers. What it replaces in
most models is the unfused expression
``(x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w``,
five kernels and an fp32 copy of the activations.
"""

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import UnsupportedOperationError
from ._infra._cached_launch import cached_launch
from ._infra._frozen_casts import frozen_scale
from ._infra._launch import (
    MAX_ROW_BLOCK,
    backward_launch,
    cdiv,
    forward_rows,
    row_groups,
    row_launch,
    rows_at_once,
    triton_or_fallback,
)
from ._infra._native import PlanTable, Replay, replayed_call
from ._infra._op import kernel_op
from ._infra._partials import sum_rows
from ._infra._recompute import mark_recomputable
from ._infra._rows import (
    as_grouped_rows,
    check_norm_args,
    normalized,
    output_dtype,
    param_row,
    trained_dtypes,
)

__all__ = ["fused_rmsnorm", "mark_normed", "replay_rmsnorm", "run_rmsnorm", "torch_rmsnorm"]


# -- kernels ---------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _rmsnorm_fwd(
    x_ptr,  # (M, N) input, unit stride along N (GROUPED: (M / (G * H), G, H, N))
    r_ptr,  # (M, N) residual added to x first, x's row stride (read when HAS_RESIDUAL)
    h_ptr,  # (M, N) the sum x + r, x's row stride (written when HAS_RESIDUAL); GROUPED
    # with STATS: x's rows as read, y's row stride (what the backward keeps)
    y_ptr,  # (M, N) output
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    rstd_ptr,  # (M,) fp32 row 1/rms
    x_row_stride,
    y_row_stride,
    M,
    N,
    eps,
    G,  # GROUPED: subgroups per group
    H,  # GROUPED: rows per subgroup (the row stride is x_row_stride)
    x_group_stride,  # GROUPED
    x_subgroup_stride,  # GROUPED
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STATS: tl.constexpr,  # whether 1/rms is written (for a backward)
    GROUPED: tl.constexpr,  # x's rows in groups (a per-head view of wider rows)
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program takes (narrow rows: several)
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    tile = (rows < M)[:, None] & (cols < N)[None, :]
    if GROUPED:
        x_at = (rows // (G * H)) * x_group_stride + ((rows // H) % G) * x_subgroup_stride
        x_at += (rows % H) * x_row_stride
    else:
        x_at = rows * x_row_stride
    x_at = x_at[:, None] + cols[None, :]
    y_at = rows[:, None] * y_row_stride + cols[None, :]
    x = tl.load(x_ptr + x_at, mask=tile, other=0.0)
    if GROUPED and STATS:  # dense rows for the backward, written as they are read
        tl.store(h_ptr + y_at, x, mask=tile)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        # The sum in fp32, rounded once to h's dtype; the norm reads it as stored, as an
        # add followed by a norm does.
        r = tl.load(r_ptr + x_at, mask=tile, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + x_at, h, mask=tile)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + y_at, y.to(y_ptr.dtype.element_ty), mask=tile)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)


@cached_launch
@triton.jit
def _rmsnorm_fwd_looped(
    x_ptr,  # (M, N) input, unit stride along N
    y_ptr,  # (M, N) output
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    rstd_ptr,  # (M,) fp32 row 1/rms
    x_row_stride,
    y_row_stride,
    N,
    eps,
    HAS_WEIGHT: tl.constexpr,
    STATS: tl.constexpr,  # whether 1/rms is written (for a backward)
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        y = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(rstd_ptr + row, rstd)


@cached_launch
@triton.jit
def _rmsnorm_bwd(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    rstd_ptr,  # (M,) fp32 from the forward
    dx_ptr,  # (M, N) input gradient
    dres_ptr,  # (M, N) gradient added to dx, dx's row stride (read when HAS_DRES)
    dx2_ptr,  # (M, N) second copy of dx in its own dtype, dx's row stride (SECOND_DX)
    dw_ptr,  # (P, N) fp32 partial weight gradients, one row per program (WEIGHT_GRAD)
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    M,
    N,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,  # the weight's gradient wanted (not for a frozen one)
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
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        xhat = x * rstd
        g = dy * w[None, :] if HAS_WEIGHT else dy
        c1 = tl.sum(xhat * g, axis=1)[:, None] / N
        dx = (g - xhat * c1) * rstd
        dx_offsets = rows[:, None] * dx_row_stride + cols[None, :]
        if HAS_DRES:
            dx += tl.load(dres_ptr + dx_offsets, mask=tile, other=0.0).to(tl.float32)
        tl.store(dx_ptr + dx_offsets, dx.to(dx_ptr.dtype.element_ty), mask=tile)
        if SECOND_DX:
            tl.store(dx2_ptr + dx_offsets, dx.to(dx2_ptr.dtype.element_ty), mask=tile)
        if WEIGHT_GRAD:
            dw += tl.sum(dy * xhat, axis=0)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + pid * N + cols, dw, mask=mask)


@cached_launch
@triton.jit
def _rmsnorm_bwd_looped(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    w_ptr,  # (N,) weight (read when HAS_WEIGHT)
    rstd_ptr,  # (M,) fp32 from the forward
    dx_ptr,  # (M, N) input gradient
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    N,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc += x * rstd * dy
    c1 = tl.sum(acc, axis=0) / N
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dx = (dy - x * rstd * c1) * rstd
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _rmsnorm_bwd_weight(
    dy_ptr,  # (M, N) output gradient, unit stride along N
    x_ptr,  # (M, N) forward input
    rstd_ptr,  # (M,) fp32 from the forward
    dw_ptr,  # (P, N) fp32 partial weight gradients, one row per row-group
    dy_row_stride,
    x_row_stride,
    M,
    N,
    rows_per_program,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for r in range(first, last):
        row = tl.cast(r, tl.int64)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dw += dy * x * tl.load(rstd_ptr + row)
    tl.store(dw_ptr + group * N + cols, dw, mask=mask)


# -- launchers -------------------------------------------------------------------------------
def rmsnorm_forward(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    y: Tensor,
    rstd: Tensor | None,
    residual: Tensor | None = None,
    total: Tensor | None = None,
) -> None:
    """Write the forward of ``x`` (M, N) into ``y`` (M, N) and ``rstd`` (M,; None: a
    forward without a backward, which skips writing it).

    ``x`` may be grouped rows, (M / H, H, N) or (M / (G * H), G, H, N)
    (:func:`~._infra._rows.as_grouped_rows`; rows of at most :data:`MAX_ROW_BLOCK`, no
    residual): with ``rstd``, its rows are written into
    ``total`` (M, N), dense, as they are read (what a backward takes). With ``residual``
    (and ``total``, laid out as ``x``; rows of at most :data:`MAX_ROW_BLOCK`),
    ``x + residual`` is written into ``total`` and normalised.
    """
    m, n = y.shape
    if m == 0:
        return
    has_residual = residual is not None
    block, warps, looped = row_launch(n, (total if has_residual else x).element_size())
    w, stats = x if weight is None else weight, y if rstd is None else rstd
    flags = {"HAS_WEIGHT": weight is not None, "STATS": rstd is not None, "BLOCK_N": block}
    if looped:
        if has_residual:
            raise UnsupportedOperationError(
                f"rmsnorm_forward: a residual needs rows of at most {MAX_ROW_BLOCK}, got {n}"
            )
        _rmsnorm_fwd_looped[(m,)](
            x, y, w, stats, x.stride(0), y.stride(0), n, eps, **flags, num_warps=warps
        )
        return
    rows, warps = forward_rows(block, warps)
    _rmsnorm_fwd[(cdiv(m, rows),)](
        x, residual if has_residual else x, x if total is None else total, y, w, stats,
        x.stride(-2), y.stride(0), m, n, eps, *_groups(x), **flags,
        HAS_RESIDUAL=has_residual, GROUPED=x.dim() > 2, BLOCK_M=rows, num_warps=warps,
    )  # fmt: skip


def _groups(x: Tensor) -> tuple[int, int, int, int]:
    """(G, H, group stride, subgroup stride) of grouped rows ``x``, (M / (G * H), G, H,
    N) or (M / H, H, N) (G = 1); (1, 1, 0, 0) for plain rows, which the kernels then read
    by their row stride alone."""
    if x.dim() == 4:
        return x.shape[1], x.shape[2], x.stride(0), x.stride(1)
    if x.dim() == 3:
        return 1, x.shape[1], x.stride(0), 0
    return 1, 1, 0, 0


def rmsnorm_backward(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    dx: Tensor,
    grad_dtype: torch.dtype = torch.float32,
    dres: Tensor | None = None,
    dx2: Tensor | None = None,
    weight_grad: bool = True,
) -> Tensor | None:
    """Write the input gradient into ``dx``; return the weight gradient in
    ``grad_dtype``, summed in fp32 (None without a weight, or where ``weight_grad`` is
    False: a frozen weight's, which nothing then computes).

    ``dres`` (laid out as ``dx``): a gradient added to the input gradient; ``dx2``: a
    second copy of it in ``dx2``'s dtype (rows of at most :data:`MAX_ROW_BLOCK` for
    either). A residual add's backward, fused.
    """
    m, n = x.shape
    has_weight = weight is not None
    summed = has_weight and weight_grad
    if m == 0:
        return x.new_zeros(n, dtype=grad_dtype) if summed else None
    block, warps, looped = row_launch(n, x.element_size())
    if looped and (dres is not None or dx2 is not None):
        raise UnsupportedOperationError(
            f"rmsnorm_backward: dres and dx2 need rows of at most {MAX_ROW_BLOCK}, got {n}"
        )
    w = x if weight is None else weight
    if not looped:
        warps, per_sm = backward_launch(block, x.element_size())
        programs, per_program = row_groups(x.device, m, per_sm)
        # (without WEIGHT_GRAD the kernel writes no partials: any pointer will do)
        dw = torch.empty((programs, n), device=x.device, dtype=torch.float32) if summed else rstd
        _rmsnorm_bwd[(programs,)](
            dy, x, w, rstd, dx, dx if dres is None else dres, dx if dx2 is None else dx2, dw,
            dy.stride(0), x.stride(0), dx.stride(0), m, n, per_program,
            HAS_WEIGHT=has_weight, WEIGHT_GRAD=summed, HAS_DRES=dres is not None,
            SECOND_DX=dx2 is not None,
            BLOCK_N=block, BLOCK_M=rows_at_once(block), num_warps=warps,
        )  # fmt: skip
    else:
        _rmsnorm_bwd_looped[(m,)](
            dy, x, w, rstd, dx, dy.stride(0), x.stride(0), dx.stride(0), n,
            HAS_WEIGHT=has_weight, BLOCK_N=block, num_warps=warps,
        )  # fmt: skip
        if not summed:
            return None
        groups, per_group = row_groups(x.device, m, per_sm=4)
        dw = torch.empty((groups, n), device=x.device, dtype=torch.float32)
        _rmsnorm_bwd_weight[(cdiv(n, block), groups)](
            dy, x, rstd, dw, dy.stride(0), x.stride(0), m, n, per_group,
            BLOCK_N=block, num_warps=warps,
        )  # fmt: skip
    return sum_rows(dw, grad_dtype) if summed else None


# -- the op: the registered torch op and the eager Function, from one definition ----------------
def _forward(
    x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The output, 1/rms and, for grouped rows, the dense rows the backward takes (for
    plain rows, which it takes as they are, an empty tensor: an op's outputs may not
    alias its inputs)."""
    grouped = x.dim() > 2
    y = _rows_like(x, out_dtype)
    rstd = torch.empty(y.shape[0], device=x.device, dtype=torch.float32)
    rows = _rows_like(x, x.dtype) if grouped else x.new_empty(0)
    rmsnorm_forward(x, weight, eps, y, rstd, total=rows if grouped else None)
    return y, rstd, rows


def _forward_alone(x, weight, eps, out_dtype) -> tuple[Tensor]:
    y = _rows_like(x, out_dtype)
    rmsnorm_forward(x, weight, eps, y, None)  # no statistics to keep
    return (y,)


def _rows_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Dense (M, N) rows for rows ``x``, plain (M, N) or grouped."""
    if x.dim() > 2:
        return x.new_empty((math.prod(x.shape[:-1]), x.shape[-1]), dtype=dtype)
    return torch.empty_like(x, dtype=dtype)


def _forward_fake(x, weight, eps, out_dtype):
    rstd = x.new_empty(x.shape[0], dtype=torch.float32)
    return torch.empty_like(x, dtype=out_dtype), rstd, x.new_empty(0)


def _backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, grad_dtype: torch.dtype,
    weight_grad: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(∂x, ∂weight); ∂weight empty without a weight or where ``weight_grad`` is False."""
    dx = torch.empty_like(x)
    dw = rmsnorm_backward(dy, x, weight, rstd, dx, grad_dtype=grad_dtype, weight_grad=weight_grad)
    return dx, x.new_empty(0, dtype=grad_dtype) if dw is None else dw


def _backward_fake(dy, x, weight, rstd, grad_dtype, weight_grad):
    n = x.shape[1] if weight is not None and weight_grad else 0
    return torch.empty_like(x), x.new_empty(n, dtype=grad_dtype)


def _save(inputs, outputs):
    x, weight = inputs[:2]
    if x.dim() > 2:  # grouped rows: the dense copy the forward wrote
        x = outputs[2]
    return (x, weight, outputs[1]), trained_dtypes(weight)[0]


def _prepare(saved, w_dtype, dy):
    x, weight, rstd = saved
    return dy.contiguous(), x, weight, rstd, w_dtype or torch.float32, w_dtype is not None


def _finish(w_dtype, grads):
    dx, dw = grads
    return dx, None if w_dtype is None else dw, None, None


_rms_norm = kernel_op(
    "rms_norm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    prepare=_prepare,
    finish=_finish,
    alone=_forward_alone,
    rows=as_grouped_rows,  # a per-head q/k norm reads its heads where they lie
)


# -- the public entries ------------------------------------------------------------------------
def fused_rmsnorm(
    input: Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """RMS normalisation over the trailing ``normalized_shape`` dims, in Triton.

    Same contract as ``torch.nn.functional.rms_norm``; forward and backward run our
    kernels (fp32 accumulation) on CUDA devices, or on the CPU under
    ``TRITON_INTERPRET=1``. It is the registered op ``torch.ops.xpuruntime.rms_norm``,
    so ``torch.compile`` and CUDA-graph capture see through it.

    Parameters
    ----------
    input : Tensor (..., *normalized_shape)
        fp32, fp16 or bf16; any leading shape.
    normalized_shape : int or sequence of int
        The trailing dims normalised over.
    weight : Tensor of shape ``normalized_shape``, optional
    eps : float, optional
        Added to the mean square; None means ``torch.finfo(input.dtype).eps``, as in
        ``nn.RMSNorm``.
    out_dtype : torch.dtype, optional
        The output's float dtype (default: ``input``'s); computed in fp32 either way.

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
        or Triton is missing. Otherwise ``F.rms_norm`` runs, after a
        ``FallbackWarning``.

    Examples
    --------
    >>> y = fused_rmsnorm(x, x.shape[-1:], w, eps=1e-6)        # doctest: +SKIP
    """
    planned = replayed_call(_public_plans, input, None, normalized_shape, eps, out_dtype, weight)
    if planned is not None:  # a call of a key checked before, replayed from C++
        return planned
    shape = normalized(normalized_shape)
    check_norm_args("fused_rmsnorm", input, shape, (("weight", weight),))
    out_dtype = output_dtype("fused_rmsnorm", input, out_dtype)
    if not triton_or_fallback("fused_rmsnorm", input, *(() if weight is None else (weight,))):
        return torch_rmsnorm(input, shape, weight, eps).to(out_dtype)
    eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
    planned = replayed_call(
        _public_plans, input, None, shape, eps, out_dtype, weight, checked=True
    )  # a key's second call derives its plan
    if planned is not None:
        return planned
    return run_rmsnorm(input, math.prod(shape), weight, eps, out_dtype)


def run_rmsnorm(
    input: Tensor, n: int, weight: Tensor | None, eps: float, out_dtype: torch.dtype
) -> Tensor:
    """:func:`fused_rmsnorm` of arguments already validated (``eps`` a float), over the
    last dims of ``n`` elements: the routed op's call path (see ``run_layernorm``)."""
    return _rms_norm.on_rows(n, 1, input, param_row(weight, n), eps, out_dtype)


def mark_normed(
    y: Tensor,
    x: Tensor,
    normalized_shape: "int | tuple[int, ...] | list[int]",
    weight: Tensor | None,
    eps: float | None,
    out_dtype: torch.dtype | None,
    offset: float = 0.0,
) -> None:
    """Say that :func:`run_rmsnorm` of ``x`` (dense rows, which the norm's backward
    keeps) gives ``y`` again, bit for bit. ``eps`` and ``out_dtype`` as the norm took
    them (None: ``x``'s dtype's); ``offset``: Gemma's ``1 + weight``. Only a ``y`` with
    a gradient: otherwise no backward keeps ``x``."""
    if y.requires_grad and x.is_contiguous():
        n = normalized_shape if isinstance(normalized_shape, int) else math.prod(normalized_shape)
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        sources = (x,) if weight is None else (x, weight)
        again = functools.partial(_normed_again, n, eps, out_dtype or x.dtype, offset)
        mark_recomputable(y, again, *sources)


def _normed_again(
    n: int, eps: float, out_dtype: torch.dtype, offset: float, x: Tensor,
    weight: Tensor | None = None,
) -> Tensor:  # fmt: skip
    return run_rmsnorm(x, n, frozen_scale(weight, offset), eps, out_dtype)


_public_plans = PlanTable(lambda key: replay_rmsnorm(math.prod(key[1])))


def replay_rmsnorm(n: int, strided: bool = False) -> Replay:
    """The launch plan (:mod:`._infra._native`) of one call signature of
    :func:`run_rmsnorm`: ``replay.call(input, weight, None, None, eps, out_dtype)``
    (``strided``: derived from a strided view of rows too, such as a per-head q/k norm's
    input, which the kernels read in place)."""

    def reference(t, eps, out_dtype):
        return _rms_norm.function.apply(n, 1, t[0], param_row(t[1], n), eps, out_dtype)

    return Replay("xpuruntime::rms_norm", reference, strided=strided)


def torch_rmsnorm(
    input: Tensor, normalized_shape, weight: Tensor | None, eps: float | None
) -> Tensor:
    """PyTorch's own RMSNorm (``F.rms_norm``), what the ``torch`` kernel runs."""
    return torch.nn.functional.rms_norm(input, tuple(normalized_shape), weight, eps)

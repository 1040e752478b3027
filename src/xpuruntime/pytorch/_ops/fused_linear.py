r"""fused_linear: a linear layer whose backward writes the weight and bias gradients in the
parameters' own dtype, from fp32 accumulators, with no cast kernels.

.. math::
    y = x W^\top + b,\quad \partial x = g W,\quad \partial W = g^\top x,\quad
    \partial b = \textstyle\sum_i g_i

for :math:`x` of shape (..., K), :math:`W` (N, K), :math:`b` (N,) and the incoming
gradient :math:`g` (..., N), rows flattened.

Under autocast with fp32 parameters, ``nn.Linear``'s backward has the weight-gradient
GEMM round :math:`\partial W` to bf16/fp16 and a second kernel cast it to fp32, and it
reduces :math:`\partial b` in a generic reduction followed by another cast: per layer
two cast kernels and a reduction well under the memory bandwidth (GPT-2 124M on an
H200: 1.7 ms of bias reductions and ~1 ms of casts per training step). Here the GEMM
writes :math:`\partial W` in the weight's dtype from its fp32 accumulator
(``torch.mm(..., out_dtype=)``, one rounding less), and a Triton kernel sums the columns
of :math:`g` in fp32 tiles straight into the bias's dtype (outside a CUDA graph, a small
:math:`g`'s sums are PyTorch's one reduction, also in fp32: there the host's time per
launch decides). The forward is ``F.linear`` in the autocast dtype, as autocast runs it.

fused_linear_gelu: the same layer followed by GELU, :math:`h = \mathrm{GELU}(y)`. Its
backward forms :math:`g = \partial h \odot \mathrm{GELU}'(y)` and sums its columns in
the same kernel (one read of :math:`\partial h` and :math:`y`, one write of :math:`g`),
where PyTorch's GELU backward writes :math:`g` and the bias reduction reads it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError
from ._infra._cached_launch import cached_launch
from ._infra._capture_paths import capture_paths
from ._infra._cublaslt import gelu_aux_linear, refusal, require
from ._infra._first_order import first_order
from ._infra._grad_targets import gradient_target, targeted
from ._infra._launch import (
    FLOAT_DTYPES,
    autocast_dtype,
    cast,
    cdiv,
    check_matching_dtypes,
    mm_as,
    require_triton,
    sm_count,
    through_registered_op,
)
from ._infra._native import Replay
from ._infra._partials import sum_rows
from ._infra._rows import wants_grad

__all__ = [
    "check_linear",
    "column_sums",
    "fused_linear",
    "fused_linear_gelu",
    "gelu_backward",
    "run_linear",
]


# -- kernels ---------------------------------------------------------------------------------
@triton.jit
def _gelu_grad(x, TANH: tl.constexpr):
    """GELU'(x) in fp32, as PyTorch's gelu_backward computes it (erf or tanh form)."""
    if TANH:
        beta = 0.7978845608028654  # sqrt(2 / pi)
        kappa = 0.044715
        inner = beta * (x + kappa * x * x * x)
        # With e = exp(-2|inner|) and t = tanh(inner): 1 + t = 2 / (1 + e) (inner >= 0) or
        # 2e / (1 + e), and 1 - t^2 = 4e / (1 + e)^2, free of the cancellation of
        # 1 - tanh^2 where tanh saturates.
        e = tl.exp(-2.0 * tl.abs(inner))
        r = 1.0 / (1.0 + e)
        one_plus_t = 2.0 * r * tl.where(inner >= 0, 1.0, e)
        one_minus_t2 = 4.0 * e * r * r
        return 0.5 * one_plus_t + 0.5 * x * one_minus_t2 * beta * (1.0 + 3.0 * kappa * x * x)
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327


@cached_launch
@triton.jit
def _column_sums(
    g_ptr,  # (M, N) input, unit stride along N
    out_ptr,  # (groups, N) fp32 partial sums, one row per group of rows
    pre_ptr,  # (M, N) GELU's input, laid out as g (read when GELU)
    dg_ptr,  # (M, N) g * GELU'(pre), laid out as g (written when GELU)
    M,
    N,
    g_row_stride,
    rows_per_group,
    GELU: tl.constexpr,  # 0: the sums of g; 1: of g * GELU'(pre); 2: the same, tanh form
    SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, M)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * g_row_stride + cols[None, :]
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            x = tl.load(pre_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            d = (g * _gelu_grad(x, GELU == 2)).to(dg_ptr.dtype.element_ty)
            tl.store(dg_ptr + offsets, d, mask=mask)
            g = d.to(tl.float32)  # the sums of the gradient as stored, as the GEMMs read it
        if SUMS:
            acc += g
    if SUMS:
        tl.store(out_ptr + group * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# -- launchers -------------------------------------------------------------------------------
# Tiles of 64 rows x 64 columns, 4 warps, 8 programs per SM: within 4% of the best of a
# sweep (16-128 rows, 64-256 columns, 2-8 warps, 2-16 programs per SM) at 16384 rows of
# 768, 2304 and 3072 bf16 columns on an H200 (19.7, 36.0, 42.0 us; torch's
# sum(0, dtype=float32) 32.7, 42.8, 48.6 us).
_BLOCK_M, _BLOCK_N, _WARPS, _PER_SM = 64, 64, 4, 8
# With GELU's gradient (two reads and a write per element): tiles of 32 x 128, 8 warps,
# 4 programs per SM, best of the same sweep on an H100 at 16384 rows of 3072 and 4096
# bf16 columns (112 and 148 us, against 145 and 190 us with the tiles above; PyTorch's
# gelu_backward then sum(0): 150 and 193 us). At 8192 columns the tiles above are faster
# (349 against 366 us; PyTorch 362), so wider rows keep them.
_GELU_LAUNCH = 32, 128, 8, 4
_GELU_LAUNCH_MAX_N = 4096


def column_sums(g: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The sums over rows of ``g`` (M, N), accumulated in fp32, in ``out_dtype``.

    Each program sums a (rows, 64-column) strip in fp32 tiles; the strips' partial sums
    are added in a fixed order, so the result is deterministic.
    """
    if g.stride(-1) != 1:
        g = g.contiguous()
    return _strips(g, None, None, 0, out_dtype)


_GELU_FORMS = {"none": 1, "tanh": 2}


def gelu_backward(
    dh: Tensor, pre: Tensor, approximate: str, bias_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor | None]:
    """``dh * GELU'(pre)`` for (M, N) ``dh`` and ``pre`` (in ``pre``'s dtype), and its
    column sums in ``bias_dtype`` (None for None), in one pass over the two: the backward
    of ``gelu(x @ W.T + b)`` up to its GEMMs, with the bias gradient.

    On CUDA its launches run from C++ (:mod:`._infra._native`) from the second call of the
    same shapes and dtypes on, which derives their plan."""
    dh, pre = dh.contiguous(), pre.contiguous()
    if dh.is_cuda:
        key = (dh.shape, dh.dtype, pre.dtype, approximate, bias_dtype, dh.get_device())
        replay = _gelu_replays.get(key) or _gelu_replay(key, approximate, bias_dtype)
        out = replay.call(dh, pre, None, None, 0.0, pre.dtype)
        if out is not None:
            return (out[0], out[1]) if bias_dtype is not None else (out, None)
    return _gelu_backward_launched(dh, pre, approximate, bias_dtype)


def _gelu_backward_launched(dh, pre, approximate, bias_dtype):
    dpre = torch.empty_like(pre)
    sums = _strips(dh, pre, dpre, _GELU_FORMS[approximate], bias_dtype)
    return dpre, sums


_gelu_replays: dict[tuple, Replay] = {}


def _gelu_replay(key: tuple, approximate: str, bias_dtype: torch.dtype | None) -> Replay:
    """The replay of :func:`gelu_backward` for one call signature (at most 256 kept)."""

    def reference(t, scalar, out_dtype):
        dpre, sums = _gelu_backward_launched(t[0], t[1], approximate, bias_dtype)
        return dpre if sums is None else (dpre, sums)

    if len(_gelu_replays) >= 256:
        _gelu_replays.clear()
    _gelu_replays[key] = Replay("xpuruntime::gelu_backward", reference, False)
    return _gelu_replays[key]


def _strips(g, pre, dg, gelu: int, out_dtype: torch.dtype | None) -> Tensor | None:
    """Launch :func:`_column_sums` over ``g``; the column sums in ``out_dtype``, or None
    (then only the GELU gradient is written)."""
    m, n = g.shape
    if m == 0:
        return None if out_dtype is None else g.new_zeros(n, dtype=out_dtype)
    block_m, block_n, warps, per_sm = (_BLOCK_M, _BLOCK_N, _WARPS, _PER_SM)
    if gelu and n <= _GELU_LAUNCH_MAX_N:
        block_m, block_n, warps, per_sm = _GELU_LAUNCH
    block_n = min(block_n, max(16, 1 << (n - 1).bit_length()))
    column_blocks = cdiv(n, block_n)
    # Enough programs to fill the device (the CPU interpreter: a few), whole tiles each.
    programs = per_sm * sm_count(g.device) if g.is_cuda else 4
    groups = max(1, min(cdiv(m, block_m), cdiv(programs, column_blocks)))
    rows_per_group = cdiv(cdiv(m, groups), block_m) * block_m
    groups = cdiv(m, rows_per_group)
    sums = out_dtype is not None
    partial = torch.empty((groups if sums else 0, n), device=g.device, dtype=torch.float32)
    _column_sums[(column_blocks, groups)](
        g, partial, g if pre is None else pre, g if dg is None else dg, m, n, g.stride(0),
        rows_per_group, GELU=gelu, SUMS=sums, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
    )  # fmt: skip
    return sum_rows(partial, out_dtype) if sums else None


def linear_parameter_grads(
    g: Tensor,
    x: Tensor,
    weight_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    weight: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The weight gradient ``g.T @ x`` in ``weight_dtype`` and the bias gradient (column
    sums of ``g``) in ``bias_dtype``, for ``g`` (M, N) and ``x`` (M, K); None for a dtype
    of None (a gradient not needed). The weight gradient is written into ``weight``'s
    gradient target where it has one (:mod:`._infra._grad_targets`)."""
    dw = None
    if weight_dtype is not None:
        out = gradient_target(weight, torch.Size((g.shape[1], x.shape[1])), weight_dtype)
        dw = mm_as(g.t(), x, weight_dtype, out)
    if bias_dtype is None:
        return dw, None
    if g.numel() < _TRITON_SUMS_FROM and g.is_cuda and not capture_paths(g.device):
        # A small gradient: GPU time is a few µs either way and the host decides, where
        # PyTorch's one reduction (fp32 accumulation, written in the bias's dtype) costs
        # a launch and ours two launches and their buffers. Inside a CUDA graph launches
        # cost the host nothing, so ours runs there at every size.
        if bias_dtype == g.dtype:
            return dw, g.sum(0)
        return dw, cast(g.sum(0, dtype=torch.float32), bias_dtype)
    return dw, column_sums(g, bias_dtype)


_TRITON_SUMS_FROM = 2**23
"""Elements of a linear layer's output gradient from which its bias gradient comes from
:func:`column_sums` outside CUDA-graph capture: GPT-2's 16384 x 768 output gradient
takes 19.7 µs there against PyTorch's 32.7 on an H200, while at a quarter of that both
take a few µs of GPU time, less than the ~13 µs of host time of each of our launches."""


# -- the torch op (what torch.compile and the dispatch log see) ------------------------------
@torch.library.custom_op("xpuruntime::linear_parameter_grads", mutates_args=())
def _linear_parameter_grads(
    g: Tensor, x: Tensor, weight_dtype: torch.dtype | None, bias_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    dw, db = linear_parameter_grads(g, x, weight_dtype, bias_dtype)
    # Absent gradients come back as distinct empty tensors (a custom op's outputs may
    # not alias each other).
    return (
        g.new_empty(0) if dw is None else dw,
        g.new_empty(0) if db is None else db,
    )


@_linear_parameter_grads.register_fake
def _(g, x, weight_dtype, bias_dtype):
    n, k = g.shape[1], x.shape[1]
    dw = g.new_empty((n, k), dtype=weight_dtype) if weight_dtype is not None else g.new_empty(0)
    db = g.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else g.new_empty(0)
    return dw, db


@torch.library.custom_op("xpuruntime::gelu_backward", mutates_args=())
def _gelu_backward(
    dh: Tensor, pre: Tensor, approximate: str, bias_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    dpre, db = gelu_backward(dh, pre, approximate, bias_dtype)
    return dpre, (dh.new_empty(0) if db is None else db)


@_gelu_backward.register_fake
def _(dh, pre, approximate, bias_dtype):
    n = pre.shape[1]
    db = dh.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else dh.new_empty(0)
    return torch.empty_like(pre), db


@torch.library.custom_op("xpuruntime::gelu_aux_linear", mutates_args=())
def _gelu_aux_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return gelu_aux_linear(x, weight, bias)


@_gelu_aux_linear.register_fake
def _(x, weight, bias):
    out = x.new_empty((x.shape[0], weight.shape[0]))
    return out, torch.empty_like(out)


def _forward(x, weight, bias, compute_dtype, gelu, epilogue):
    """The layer's output, its input and weight in ``compute_dtype``, and GELU's input
    (``()`` without GELU). Every tensor is cast to ``compute_dtype`` first, so that
    autocast, when on, has nothing left to cast."""
    xc, wc = cast(x, compute_dtype), cast(weight, compute_dtype)
    bc = None if bias is None else cast(bias, compute_dtype)
    if epilogue:  # GELU's input and output from one cuBLASLt GEMM
        args = (xc.reshape(-1, xc.shape[-1]).contiguous(), wc.contiguous(), bc)
        y, p = (_gelu_aux_linear if through_registered_op() else gelu_aux_linear)(*args)
        shape = (*x.shape[:-1], wc.shape[0])
        return y.view(shape), xc, wc, (p.view(shape),)
    y = F.linear(xc, wc, bc)
    if gelu is None:
        return y, xc, wc, ()
    return F.gelu(y, approximate=gelu), xc, wc, (y,)


def _apply(x, weight, bias, compute_dtype, gelu, epilogue):
    """The layer through the autograd Function; or, when nothing needs its backward,
    its forward alone; or ``F.linear`` with PyTorch's own backward where that computes
    what ours would (the Function's bookkeeping is most of a small layer's host time)."""
    if through_registered_op():
        return _LinearFunction.apply(x, weight, bias, compute_dtype, gelu, epilogue)
    if not wants_grad(x, weight, bias):
        return _forward(x, weight, bias, compute_dtype, gelu, epilogue)[0]
    if gelu is None and _as_pytorch_computes(x, weight, bias, compute_dtype):
        return F.linear(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias, compute_dtype, gelu, epilogue)


def _as_pytorch_computes(x, weight, bias, compute_dtype) -> bool:
    """Whether PyTorch's linear backward computes what ours does: nothing is cast (so
    the weight gradient is the GEMM's output in the weight's dtype either way) and our
    bias gradient would be ``Tensor.sum`` too (a CUDA tensor, outside graph capture,
    an output below :data:`_TRITON_SUMS_FROM` elements)."""
    if not x.is_cuda or capture_paths(x.device):
        return False
    if x.dtype != compute_dtype or weight.dtype != compute_dtype:
        return False
    if bias is not None and bias.dtype != compute_dtype:
        return False
    return x.numel() // max(1, x.shape[-1]) * weight.shape[0] < _TRITON_SUMS_FROM


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, compute_dtype, gelu, epilogue):
        y, xc, wc, pre = _forward(x, weight, bias, compute_dtype, gelu, epilogue)
        ctx.save_for_backward(xc, wc, *pre)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.gelu = gelu
        ctx.weight = targeted(weight)  # where its gradient goes, if anywhere
        return y

    @staticmethod
    @first_order("fused_linear")
    def backward(ctx, dy):
        xc, wc, *pre = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = dy.reshape(-1, dy.shape[-1])
        if g.stride(-1) != 1 or g.stride(0) != g.shape[1]:
            g = g.contiguous()
        dx = dw = db = None
        if pre:
            # GELU's gradient and the bias gradient (its column sums) in one pass.
            args = (g, pre[0].reshape(g.shape), ctx.gelu, b_dtype if need_b else None)
            g, db = (_gelu_backward if through_registered_op() else gelu_backward)(*args)
            db = db if need_b else None
            if need_w:
                out = gradient_target(ctx.weight, wc.shape, w_dtype)
                dw = mm_as(g.t(), xc.reshape(-1, xc.shape[-1]), w_dtype, out)
        elif need_w or need_b:
            args = (g, xc.reshape(-1, xc.shape[-1]), w_dtype if need_w else None)
            args += (b_dtype if need_b else None,)
            if through_registered_op():
                dw, db = _linear_parameter_grads(*args)
                dw, db = (dw if need_w else None), (db if need_b else None)
            else:
                dw, db = linear_parameter_grads(*args, ctx.weight)
        if need_x:
            dx = cast((g @ wc).view(*dy.shape[:-1], wc.shape[1]), x_dtype)
        return dx, dw, db, None, None, None


# -- the public entry ------------------------------------------------------------------------
def fused_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` whose backward writes the weight and bias gradients in the parameters'
    dtype from fp32 accumulators (see the module docstring).

    The forward runs in the autocast dtype under autocast (as ``F.linear`` does), else in
    ``input``'s dtype. The bias gradient's Triton kernel runs on CUDA devices, or on the
    CPU under ``TRITON_INTERPRET=1``.

    Parameters
    ----------
    input : Tensor (..., in_features)
    weight : Tensor (out_features, in_features)
    bias : Tensor (out_features,), optional

    Returns
    -------
    Tensor (..., out_features)

    Raises
    ------
    InvalidInputError
        Mismatched shapes, a non-float dtype, or (outside autocast) an input and weight
        of different dtypes.
    UnsupportedOperationError, BackendUnavailableError
        The tensors are not on a device Triton runs on, or Triton is missing.

    Examples
    --------
    >>> with torch.autocast("cuda", dtype=torch.bfloat16):          # doctest: +SKIP
    ...     y = fused_linear(x, layer.weight, layer.bias)
    >>> y.sum().backward()  # layer.weight.grad is fp32, from the GEMM's accumulator
    """
    check_linear("fused_linear", input, weight, bias)
    require_triton("fused_linear", input, weight, *(() if bias is None else (bias,)))
    compute_dtype = autocast_dtype(input.device.type) or input.dtype
    return _apply(input, weight, bias, compute_dtype, None, False)


def fused_linear_gelu(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    approximate: str = "none",
    *,
    forward: str = "torch",
) -> Tensor:
    """``F.gelu(F.linear(input, weight, bias), approximate=approximate)`` whose backward
    computes GELU's gradient and the bias gradient in one pass, then the GEMMs of
    :func:`fused_linear`.

    The forward runs ``F.linear`` and ``F.gelu`` as PyTorch does (in the autocast dtype
    under autocast), so its output is bit-equal to the unfused pair's; or, with
    ``forward="cublaslt"``, one cuBLASLt GEMM whose GELU_AUX_BIAS epilogue writes GELU's
    input and output (:mod:`._infra._cublaslt`; within a rounding of the pair). The backward
    reads the incoming gradient and GELU's saved input once, writes GELU's input
    gradient and sums its columns into the bias gradient (fp32, in the bias's dtype),
    where PyTorch runs GELU's backward and then a reduction that reads the gradient
    again; the weight gradient comes from the GEMM's fp32 accumulator.

    Parameters
    ----------
    input : Tensor (..., in_features)
    weight : Tensor (out_features, in_features)
    bias : Tensor (out_features,), optional
    approximate : {"none", "tanh"}
        As ``F.gelu``: the exact (erf) GELU or its tanh approximation.
    forward : {"torch", "cublaslt"}
        What runs the forward: ``F.linear`` then ``F.gelu``, or cuBLASLt's GELU epilogue
        (CUDA, bf16 or fp16, ``approximate="tanh"``, features multiples of 8; needs
        nvmath-python).

    Returns
    -------
    Tensor (..., out_features)

    Raises
    ------
    InvalidInputError
        As :func:`fused_linear`, or an ``approximate`` other than "none" and "tanh", or a
        ``forward`` other than "torch" and "cublaslt".
    UnsupportedOperationError, BackendUnavailableError
        The tensors are not on a device Triton runs on, or Triton is missing; with
        ``forward="cublaslt"``, a layer the epilogue cannot run (the message says why) or
        nvmath-python missing.

    Examples
    --------
    >>> with torch.autocast("cuda", dtype=torch.bfloat16):               # doctest: +SKIP
    ...     h = fused_linear_gelu(x, mlp.c_fc.weight, mlp.c_fc.bias, approximate="tanh")
    """
    check_linear("fused_linear_gelu", input, weight, bias, approximate)
    if forward not in ("torch", "cublaslt"):
        raise InvalidInputError(
            f"fused_linear_gelu: forward must be 'torch' or 'cublaslt', got {forward!r}"
        )
    require_triton("fused_linear_gelu", input, weight, *(() if bias is None else (bias,)))
    compute_dtype = autocast_dtype(input.device.type) or input.dtype
    if forward == "cublaslt":
        refused = refusal(input.device, compute_dtype, *weight.shape[::-1], approximate)
        require("fused_linear_gelu(forward='cublaslt')", refused)
    return _apply(input, weight, bias, compute_dtype, approximate, forward == "cublaslt")


def run_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None, approximate: str | None = None
) -> Tensor:
    """:func:`fused_linear` (or, with ``approximate``, :func:`fused_linear_gelu` with
    its default forward) of arguments already validated by :func:`check_linear`, on a
    device Triton runs on: the routed op's call path, which validates a call signature
    once."""
    compute_dtype = autocast_dtype(input.device.type) or input.dtype
    return _apply(input, weight, bias, compute_dtype, approximate, False)


def check_linear(op: str, input, weight, bias, approximate: str | None = None) -> None:
    """Raise :class:`~xpuruntime.InvalidInputError` naming what is wrong with a linear
    layer's arguments (and GELU's ``approximate``, when given)."""
    if approximate is not None and approximate not in _GELU_FORMS:
        raise InvalidInputError(
            f"{op}: approximate must be 'none' or 'tanh' (as F.gelu), got {approximate!r}"
        )
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise InvalidInputError(
                f"{op}: {name} must be a float32, float16 or bfloat16 tensor, got {got}"
            )
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise InvalidInputError(
            f"{op}: input {tuple(input.shape)} must end with in_features and weight "
            f"{tuple(weight.shape)} must be (out_features, in_features)"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise InvalidInputError(
            f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    check_matching_dtypes(op, input, weight)


# -- the module --------------------------------------------------------------------------------

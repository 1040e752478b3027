r"""norm_rope: a per-head RMSNorm followed by the rotary embedding, in one pass each way
(Qwen3's and Gemma3's q/k norms: ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos,
sin)``).

Each head vector :math:`x` of width :math:`D` is normalised, :math:`n = x\,r\,(w +
o)` with :math:`r = (\overline{x^2} + \epsilon)^{-1/2}` (:math:`o`: Gemma's 1 added to
the weight), then rotated as :mod:`.rope` rotates (half-split or interleaved pairs). The
backward rotates the output gradient back and takes the norm's backward,

.. math::
    g = (w + o)\,\partial n,\quad \partial x = r\left(g - \hat{x}\,\overline{g
    \hat{x}}\right),\quad \partial w = \sum_{\text{rows}} \partial n\,\hat{x}.

Separately the norm writes its output, the rope reads it and writes its own, and each
backward does the same: two passes over q and k each way where one does. The input is
read where it lies (a (B, H, T, D) view of the joined q/k/v projection); what the
backward keeps is a dense copy of it, written as it is read, and 1/rms. The output is
(B, T, H, D) in memory, returned as its (B, H, T, D) view, as the attention kernels
read it. Computed in fp32 and rounded once: the two ops round the norm's output to the
input's dtype first.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._infra._cached_launch import cached_launch
from ._infra._launch import (
    backward_launch,
    cdiv,
    forward_rows,
    row_groups,
    row_launch,
    rows_at_once,
    through_registered_op,
)
from ._infra._native import PlanTable, Replay
from ._infra._op import kernel_op
from ._infra._partials import sum_rows

__all__ = ["run_norm_rope", "torch_norm_rope"]


# -- kernels ---------------------------------------------------------------------------------
@triton.jit
def _pairs(BLOCK: tl.constexpr, HALF, INTERLEAVED: tl.constexpr):
    """The pairs' places in a row: (first, second, mask), each (1, BLOCK)."""
    i = tl.arange(0, BLOCK)[None, :]
    if INTERLEAVED:
        return 2 * i, 2 * i + 1, i < HALF
    return i, i + HALF, i < HALF


@triton.jit
def _angles(cos_ptr, sin_ptr, at, first, second, mask):
    c1 = tl.load(cos_ptr + at + first, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + at + second, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + at + first, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + at + second, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@cached_launch
@triton.jit
def _norm_rope_fwd(
    x_ptr,  # (B, H, T, D), any strides but a unit last one
    w_ptr,  # (D,) weight
    cos_ptr,  # (B or 1, T, D), unit last stride
    sin_ptr,  # same strides as cos
    y_ptr,  # (B, T, H, D) output, dense
    rows_ptr,  # (B, T, H, D) x's rows as read, dense (written when STATS)
    rstd_ptr,  # (B * T * H,) fp32 row 1/rms (written when STATS)
    M,  # B * T * H rows, in (b, t, h) order
    H,
    T,
    HALF,  # D / 2
    sxb,
    sxh,
    sxt,
    scb,  # 0 for angles shared by the batch
    sct,
    eps,
    OFFSET: tl.constexpr,  # Gemma's 1 (a constant: a plan holds no float but eps)
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    STATS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h, t, b = m % H, (m // H) % T, m // (H * T)
    first, second, cols = _pairs(BLOCK, HALF, INTERLEAVED)
    mask = (m < M)[:, None] & cols
    x_at = (b * sxb + h * sxh + t * sxt)[:, None]
    x1 = tl.load(x_ptr + x_at + first, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + x_at + second, mask=mask, other=0.0)
    dense = m[:, None] * (2 * HALF)
    if STATS:
        tl.store(rows_ptr + dense + first, x1, mask=mask)
        tl.store(rows_ptr + dense + second, x2, mask=mask)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + first, mask=cols, other=0.0).to(tl.float32) + OFFSET
    w2 = tl.load(w_ptr + second, mask=cols, other=0.0).to(tl.float32) + OFFSET
    n1 = x1 * rstd[:, None] * w1
    n2 = x2 * rstd[:, None] * w2
    c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, (b * scb + t * sct)[:, None], first, second, mask)
    tl.store(y_ptr + dense + first, (n1 * c1 - n2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + dense + second, (n2 * c2 + n1 * s2).to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(rstd_ptr + m, rstd, mask=m < M)


@cached_launch
@triton.jit
def _norm_rope_bwd(
    dy_ptr,  # (B, H, T, D) output gradient, any strides but a unit last one
    rows_ptr,  # (B, T, H, D) the forward's input rows, dense
    rstd_ptr,  # (B * T * H,) fp32
    w_ptr,  # (D,)
    cos_ptr,
    sin_ptr,
    dx_ptr,  # (B, T, H, D) input gradient, dense
    dw_ptr,  # (P, D) fp32 partial weight gradients, one row per program (WEIGHT_GRAD)
    M,
    H,
    T,
    HALF,
    sdb,
    sdh,
    sdt,
    scb,
    sct,
    rows_per_program,
    OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
):
    pid = tl.program_id(0)
    first, second, cols = _pairs(BLOCK, HALF, INTERLEAVED)
    w1 = tl.load(w_ptr + first, mask=cols, other=0.0).to(tl.float32) + OFFSET
    w2 = tl.load(w_ptr + second, mask=cols, other=0.0).to(tl.float32) + OFFSET
    dw1 = tl.zeros([1, BLOCK], dtype=tl.float32)
    dw2 = tl.zeros([1, BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    last = tl.minimum(start + rows_per_program, M)
    for r in range(start, last, ROWS):
        m = (r + tl.arange(0, ROWS)).to(tl.int64)
        h, t, b = m % H, (m // H) % T, m // (H * T)
        mask = (m < last)[:, None] & cols
        dy_at = (b * sdb + h * sdh + t * sdt)[:, None]
        dy1 = tl.load(dy_ptr + dy_at + first, mask=mask, other=0.0).to(tl.float32)
        dy2 = tl.load(dy_ptr + dy_at + second, mask=mask, other=0.0).to(tl.float32)
        at = (b * scb + t * sct)[:, None]
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, at, first, second, mask)
        dn1 = dy1 * c1 + dy2 * s2  # the rotation's transpose
        dn2 = dy2 * c2 - dy1 * s1
        dense = m[:, None] * (2 * HALF)
        rstd = tl.load(rstd_ptr + m, mask=m < last, other=0.0)[:, None]
        xh1 = tl.load(rows_ptr + dense + first, mask=mask, other=0.0).to(tl.float32) * rstd
        xh2 = tl.load(rows_ptr + dense + second, mask=mask, other=0.0).to(tl.float32) * rstd
        g1, g2 = dn1 * w1, dn2 * w2
        c = (tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1))[:, None] / (2 * HALF)
        dx1 = (g1 - xh1 * c) * rstd
        dx2 = (g2 - xh2 * c) * rstd
        tl.store(dx_ptr + dense + first, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + dense + second, dx2.to(dx_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dw1 += tl.sum(dn1 * xh1, axis=0)[None, :]
            dw2 += tl.sum(dn2 * xh2, axis=0)[None, :]
    if WEIGHT_GRAD:
        tl.store(dw_ptr + pid * (2 * HALF) + first, dw1, mask=cols)
        tl.store(dw_ptr + pid * (2 * HALF) + second, dw2, mask=cols)


# -- launchers -------------------------------------------------------------------------------
def _heads_last(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A dense (B, T, H, D) tensor for ``x`` (B, H, T, D), as its (B, H, T, D) view."""
    batch, heads, length, width = x.shape
    return x.new_empty((batch, length, heads, width), dtype=dtype).transpose(1, 2)


def _forward(
    x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, offset: float,
    interleaved: bool, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The output, x's rows as read (dense) and 1/rms."""
    y, rows = _heads_last(x, out_dtype), _heads_last(x, x.dtype)
    rstd = x.new_empty(x.numel() // max(1, x.shape[-1]), dtype=torch.float32)
    _launch_forward(x, weight, cos, sin, eps, offset, interleaved, y, rows, rstd)
    return y, rows, rstd


def _forward_alone(x, weight, cos, sin, eps, offset, interleaved, out_dtype) -> tuple[Tensor]:
    y = _heads_last(x, out_dtype)
    _launch_forward(x, weight, cos, sin, eps, offset, interleaved, y, None, None)
    return (y,)


def _launch_forward(x, weight, cos, sin, eps, offset, interleaved, y, rows, rstd) -> None:
    batch, heads, length, width = x.shape
    m = batch * heads * length
    if m == 0:
        return
    stats = rstd is not None
    block = triton.next_power_of_2(width // 2)
    per_program, warps = forward_rows(2 * block, row_launch(width, x.element_size())[1])
    _norm_rope_fwd[(cdiv(m, per_program),)](
        x, weight, cos, sin, y, rows if stats else y, rstd if stats else y, m, heads, length,
        width // 2, x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), eps, OFFSET=offset,
        ROWS=per_program, BLOCK=block, INTERLEAVED=interleaved, STATS=stats,
        num_warps=warps,
    )  # fmt: skip


def _forward_fake(x, weight, cos, sin, eps, offset, interleaved, out_dtype):
    rows = x.numel() // max(1, x.shape[-1])
    return (_heads_last(x, out_dtype), _heads_last(x, x.dtype),
            x.new_empty(rows, dtype=torch.float32))  # fmt: skip


def _backward(
    dy: Tensor, rows: Tensor, rstd: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
    offset: float, interleaved: bool, weight_grad: bool, grad_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(∂x as x's (B, H, T, D) view of dense (B, T, H, D), ∂weight; empty where
    ``weight_grad`` is False)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    batch, heads, length, width = dy.shape
    dx = _heads_last(dy, rows.dtype)
    m = batch * heads * length
    if m == 0:
        dw = weight.new_zeros(width, dtype=grad_dtype)
        return dx, dw if weight_grad else weight.new_empty(0, dtype=grad_dtype)
    half = width // 2
    block = triton.next_power_of_2(half)
    warps, per_sm = backward_launch(2 * block, rows.element_size())
    programs, per_program = row_groups(dy.device, m, per_sm)
    dw = torch.empty((programs, width), device=dy.device, dtype=torch.float32)
    _norm_rope_bwd[(programs,)](
        dy, rows, rstd, weight, cos, sin, dx, dw, m, heads, length, half,
        dy.stride(0), dy.stride(1), dy.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1), per_program, OFFSET=offset, ROWS=rows_at_once(2 * block), BLOCK=block,
        INTERLEAVED=interleaved, WEIGHT_GRAD=weight_grad, num_warps=warps,
    )  # fmt: skip
    if not weight_grad:
        return dx, weight.new_empty(0, dtype=grad_dtype)
    return dx, sum_rows(dw, grad_dtype)


def _backward_fake(dy, rows, rstd, weight, cos, sin, offset, interleaved, weight_grad, grad_dtype):
    n = weight.shape[0] if weight_grad else 0
    return _heads_last(dy, rows.dtype), weight.new_empty(n, dtype=grad_dtype)


def _save(inputs, outputs):
    _, weight, cos, sin, _, offset, interleaved, _ = inputs
    state = (offset, interleaved, weight.requires_grad, weight.dtype)
    return (outputs[1], outputs[2], weight, cos, sin), state


def _prepare(saved, state, dy):
    rows, rstd, weight, cos, sin = saved
    offset, interleaved, weight_grad, w_dtype = state
    return dy, rows, rstd, weight, cos, sin, offset, interleaved, weight_grad, w_dtype


def _finish(state, grads):
    dx, dw = grads
    return dx, dw if state[2] else None, None, None, None, None, None, None


_norm_rope = kernel_op(
    "rms_norm_rope",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    prepare=_prepare,
    finish=_finish,
    alone=_forward_alone,
)


# -- the entries -----------------------------------------------------------------------------
def run_norm_rope(
    x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, offset: float = 0.0,
    interleaved: bool = False, out_dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """``x`` (B, H, T, D) normalised over D by ``weight + offset`` and rotated by
    ``cos``/``sin`` (B or 1, T, D), on checked arguments: one Triton pass each way. The
    result is a (B, H, T, D) view of dense (B, T, H, D), in ``out_dtype`` (default
    ``x``'s)."""
    if sin.dtype != cos.dtype:
        sin = sin.to(cos.dtype)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    eps, offset, interleaved = float(eps), float(offset), bool(interleaved)
    out_dtype = out_dtype or x.dtype
    planned = _planned(x, weight, cos, sin, eps, offset, interleaved, out_dtype)
    if planned is not None:
        return planned
    return _norm_rope(x, weight, cos, sin, eps, offset, interleaved, out_dtype)


def _planned(x, weight, cos, sin, eps, offset, interleaved, out_dtype) -> Tensor | None:
    """The training call run by its launch plan (:mod:`._infra._native`: the kernels
    launched from C++ under one autograd node), or None: the caller runs the Python path.
    Plain CUDA tensors with a gradient to take, outside torch.compile and the dispatch
    log. The key holds what the plan bakes in and does not check per call (the input's
    strides, whether the weight trains, the offset and the pairs' layout); the plan
    checks the rest (shapes, dtypes, contiguity) and refuses, with None, what it was not
    derived for."""
    if (
        x.__class__ is not Tensor
        or not x.is_cuda
        or not torch.is_grad_enabled()
        or not (x.requires_grad or weight.requires_grad)
        or through_registered_op()
        or weight.__class__ not in (Tensor, torch.nn.Parameter)
        or cos.__class__ is not Tensor
        or sin.__class__ is not Tensor
    ):
        return None
    key = (tuple(x.shape), x.stride(), x.dtype, x.get_device(), weight.dtype,
           weight.requires_grad, tuple(cos.shape), cos.dtype, offset, interleaved)  # fmt: skip
    return _plans.get(key).call(x, weight, cos, sin, eps, out_dtype)


def _plan(key: tuple) -> Replay:
    offset, interleaved = key[-2:]

    def reference(t, eps, out_dtype):
        return _norm_rope.function.apply(None, 0, *t, eps, offset, interleaved, out_dtype)

    # The output is a per-head view of token-major memory, and attention hands its
    # gradient back so: the backward plan reads it as it comes, not copied.
    return Replay("xpuruntime::rms_norm_rope", reference, strided=True, grads_as_results=True)


_plans = PlanTable(_plan)


def torch_norm_rope(
    x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, offset: float = 0.0,
    interleaved: bool = False,
) -> Tensor:  # fmt: skip
    """PyTorch's expression of :func:`run_norm_rope`, in fp32 (float64 for float64
    ``x``), rounded to ``x``'s dtype once."""
    from .rope import _rotate_half, _rotate_pairs

    f = torch.promote_types(x.dtype, torch.float32)
    normed = torch.nn.functional.rms_norm(x.to(f), (x.shape[-1],), weight.to(f) + offset, eps)
    rotate = _rotate_pairs if interleaved else _rotate_half
    cos, sin = cos.to(f).unsqueeze(1), sin.to(f).unsqueeze(1)
    return (normed * cos + rotate(normed) * sin).to(x.dtype)


# -- both heads' norms and the rope, as an attention calls them --------------------------------
def run_rmsnorm_rope(
    q: Tensor, k: Tensor, q_norm, k_norm, cos: Tensor, sin: Tensor, interleaved: bool,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``rope(q_norm(q), k_norm(k), cos, sin)`` for our RMSNorm modules over the head
    width (``weight_offset`` and ``eps`` as they hold them; None: the input dtype's
    epsilon), each tensor in one pass each way; ``out_dtype`` as the norms would emit."""
    out = []
    for x, norm in ((q, q_norm), (k, k_norm)):
        eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
        out.append(
            run_norm_rope(x, norm.weight, cos, sin, eps, norm.weight_offset, interleaved, out_dtype)
        )
    return out[0], out[1]


def torch_rmsnorm_rope(
    q: Tensor, k: Tensor, q_norm, k_norm, cos: Tensor, sin: Tensor, interleaved: bool,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """PyTorch's expression of :func:`run_rmsnorm_rope`: ``F.rms_norm`` of each, then
    the rope's elementwise expression."""
    from .rope import torch_rope

    normed = []
    for x, norm in ((q, q_norm), (k, k_norm)):
        weight = norm.weight + norm.weight_offset if norm.weight_offset else norm.weight
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, norm.eps)
        normed.append(y.to(out_dtype) if out_dtype is not None else y)
    return torch_rope(*normed, cos, sin, interleaved)

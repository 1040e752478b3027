r"""fused_linear_cross_entropy: a language-model head and its cross-entropy loss, without
materialising the logits.

For hidden states :math:`x \in \mathbb{R}^{N \times H}`, an output projection
:math:`W \in \mathbb{R}^{V \times H}` (and bias :math:`b`) and targets :math:`t`:

.. math::
    z = x W^\top + b,\quad \ell_i = \log\sum_j e^{z_{ij}} - z_{i t_i},\quad
    L = \tfrac{1}{|\{i: t_i \ne \text{ignore}\}|}\sum_i \ell_i \ \text{(mean)}

and, with :math:`p = \operatorname{softmax}(z)` and :math:`g = s\,(p - \mathbb{1}_{t})`
(:math:`s` the reduction's scale times the incoming gradient, 0 for ignored rows):

.. math::
    \partial x = g W,\quad \partial W = g^\top x,\quad \partial b = \textstyle\sum_i g_i

Models that transform their logits before the loss are taken as they write it: a scale
(Granite's ``/ logits_scaling``, Cohere's ``* logit_scale``), :math:`z \mapsto a z`, and
a soft cap (Gemma 2's ``final_logit_softcapping``), :math:`z \mapsto c \tanh(z / c)`,
applied to each logit inside the kernel (the gradient's factor :math:`a` and
:math:`1 - \tanh^2` with it).

The rows are processed in chunks: a chunk's logits are computed by one GEMM (into one
buffer every chunk reuses, over a vocabulary padded to a multiple of 8 with zero rows of
the head, so that cuBLAS takes its aligned kernels), one Triton kernel turns them in place into their loss and gradient (an online log-sum-exp pass and
a gradient pass, fp32 arithmetic), and two GEMMs fold the gradient into :math:`\partial x`
and :math:`\partial W` (fp32 accumulation). The gradients are computed in the forward,
since the loss is a scalar, without :math:`s` (which would push fp16 softmax terms below
fp16's normal range); the backward applies :math:`s` in fp32. At no
point do the full (N, V) logits exist, in any precision: PyTorch's ``F.linear`` +
``F.cross_entropy`` under autocast keeps bf16 logits, an fp32 copy, the fp32
log-softmax and an fp32 gradient of each (for GPT-2 at 16x1024 tokens, 3.3 GB apiece).
The same idea as Liger-Kernel's FusedLinearCrossEntropy (Hsu et al., 2024,
arXiv:2410.10989) and Wijmans et al., "Cut Your Losses in Large-Vocabulary Language
Models" (2024, arXiv:2411.09009).
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError, UnsupportedOperationError
from ._infra._cached_launch import cached_launch
from ._infra._first_order import first_order
from ._infra._grad_targets import gradient_target, targeted
from ._infra._launch import (
    ADDMM_TO_FP32,
    FLOAT_DTYPES,
    MM_TO_FP32,
    autocast_dtype,
    cdiv,
    check_matching_dtypes,
    require_triton,
)

__all__ = ["chunk_rows", "fused_linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum")
_CHUNK_BYTES = 512 * 2**20
"""The logits of one chunk stay under this many bytes. Fewer rows per chunk hold less
memory but cost time: each chunk adds its product into the fp32 weight gradient, a read
and a write of all of it (Llama 3's 128256 x 2048 head: 1 GiB each way). On an H100,
Llama-3.2-1B at B4 x T2048 trained 10 ms/step slower with 128 MiB chunks (16 instead of
4) and peaked only 0.1 GiB lower (2026-11-25)."""
_FROZEN_CHUNK_BYTES = 256 * 2**20
"""The same for a head whose weight has no gradient (LoRA's): no chunk reads or writes a
weight gradient, so smaller chunks cost little, and the logits buffer is live at the
step's peak (the loss, every activation kept)."""


# -- kernels ---------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _cross_entropy_rows(
    logits_ptr,  # (M, V) logits in; their loss gradient out, in place, when WRITE_GRAD
    target_ptr,  # (M,) int class indices
    loss_ptr,  # (M,) fp32 per-row loss (0 for ignored rows)
    logits_row_stride,
    V,
    ignore_index,
    pre,  # each logit z is taken as post * tanh(pre * z) when SOFTCAP, else pre * z
    post,
    WRITE_GRAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    # Online log-sum-exp, one running (max, sum) per lane, merged at the end. The
    # running max starts finite, so that lanes past V (loaded as -inf) add exp(-inf) = 0.
    m = tl.full([BLOCK_V], -1.0e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = _transformed(
            tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32), pre, post, SOFTCAP
        )
        z = tl.where(cols < V, z, -float("inf"))
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    lse = row_max + tl.log(total)
    # A target outside [0, V) cannot be checked on the host without a sync: its row's
    # loss is NaN (never a read out of bounds), so the mean shows it.
    in_range = (target >= 0) & (target < V)
    z_target = tl.load(base + tl.where(in_range, target, 0)).to(tl.float32)
    z_target = _transformed(z_target, pre, post, SOFTCAP)
    row_loss = tl.where(in_range, lse - z_target, float("nan"))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, row_loss))
    if WRITE_GRAD:
        keep = tl.where(ignored, 0.0, 1.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                t = _tanh(pre * z)
                g = (tl.exp(post * t - lse) - tl.where(cols == target, 1.0, 0.0)) * keep
                g = g * (pre * post) * (1.0 - t * t)
            else:
                g = (tl.exp(pre * z - lse) - tl.where(cols == target, 1.0, 0.0)) * (keep * pre)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _transformed(z, pre, post, SOFTCAP: tl.constexpr):
    if SOFTCAP:
        return post * _tanh(pre * z)
    return pre * z


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp's overflow gives 1, its
    # underflow -1), where (e^2x - 1) / (e^2x + 1) gives inf / inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# -- launchers -------------------------------------------------------------------------------
def chunk_rows(rows: int, vocab: int, hidden: int, element_size: int, weight_grad: bool) -> int:
    """Rows per chunk, chunks even. Where the head's fp32 weight gradient is accumulated
    over the chunks, a chunk's logits stay under 512 MiB or that gradient's size if it is
    larger: each chunk reads and writes all of it, so fewer chunks save its traffic,
    while the logits buffer stays no larger than the gradient the step holds anyway.
    A frozen head's chunks stay under 256 MiB (``benchmarks/bench_head.py``)."""
    budget = max(_CHUNK_BYTES, 4 * vocab * hidden) if weight_grad else _FROZEN_CHUNK_BYTES
    limit = max(1, budget // max(1, vocab * element_size))
    chunks = cdiv(rows, limit)
    return cdiv(rows, max(1, chunks))


def cross_entropy_rows(
    logits: Tensor,
    target: Tensor,
    loss: Tensor,
    ignore_index: int,
    grad: bool,
    scale: float = 1.0,
    softcap: float | None = None,
) -> None:
    """Write each row's loss into ``loss`` and, when ``grad``, the logits' gradient
    (``softmax - onehot`` through the transform, 0 for ignored rows) over ``logits`` in
    place; each logit ``z`` is taken as ``z * scale``, then soft-capped as
    ``softcap * tanh(z / softcap)`` when ``softcap`` is given."""
    m, v = logits.shape
    if m == 0:
        return
    # Blocks of 8192 with 16 warps: 4096 rows of 50304 bf16 logits (loss and gradient) in
    # 379 us on an H100, against 429 us with 4096 and 8 warps (a copy of the chunk: 277).
    block = min(1 << (v - 1).bit_length(), 8192)
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    pre, post = (scale, 1.0) if softcap is None else (scale / softcap, softcap)
    _cross_entropy_rows[(m,)](
        logits, target, loss, logits.stride(0), v, ignore_index, float(pre), float(post),
        WRITE_GRAD=grad, SOFTCAP=softcap is not None, BLOCK_V=block, num_warps=warps,
    )  # fmt: skip


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with fp32 accumulation, whatever the dtype of ``a`` and ``b``."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and ADDMM_TO_FP32:
        # The GEMM reads acc in its epilogue: no product matrix written, no add kernel.
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.is_cuda and MM_TO_FP32:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


_VOCAB_ALIGNMENT = 8
"""The GEMMs run over a vocabulary padded to a multiple of this many classes (zero rows of
the weight, whose logits and gradients are never read). cuBLAS takes its aligned kernels
only where the dimension the logits are contiguous in is a multiple of 8 (16 bytes of
bf16): with GPT-2's 50257 all three GEMMs of a chunk ran sm75 ``align1`` kernels, 15.7 ms
of a 38 ms GPT-2 124M step at B4 x T2048 on an H200."""


def _padded(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``weight`` (V, H) and ``bias`` with zero rows appended up to a multiple of
    :data:`_VOCAB_ALIGNMENT` (themselves where V is one)."""
    v = weight.shape[0]
    pad = -v % _VOCAB_ALIGNMENT
    if pad == 0:
        return weight, bias
    padded = weight.new_zeros((v + pad, weight.shape[1]))
    padded[:v] = weight
    if bias is not None:
        bias = torch.cat([bias, bias.new_zeros(pad)])
    return padded, bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, chunk, logit_scale, softcap):
        n, v = x.shape[0], weight.shape[0]
        grad_x_needed, grad_w_needed, grad_b_needed = ctx.needs_input_grad[:3]
        grad = grad_x_needed or grad_w_needed or grad_b_needed
        valid = (target != ignore_index).sum()
        scale = (
            (1.0 / valid.float()) if reduction == "mean" else x.new_ones((), dtype=torch.float32)
        )
        rows = torch.empty(n, device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(x) if grad_x_needed else None
        w, b = _padded(weight, bias)
        grad_w = (
            torch.zeros(w.shape, device=x.device, dtype=torch.float32) if grad_w_needed else None
        )
        grad_b = torch.zeros(v, device=x.device, dtype=torch.float32) if grad_b_needed else None
        # One buffer for every chunk's logits: a chunk's GEMM writes into it, so that the
        # next chunk's logits are not allocated while the last one's are still held.
        buffer = x.new_empty((min(chunk, n), w.shape[0]))
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            xc = x[start:end]
            logits = buffer[: end - start]
            if b is not None:
                torch.addmm(b, xc, w.t(), out=logits)
            else:
                torch.mm(xc, w.t(), out=logits)
            cross_entropy_rows(
                logits[:, :v], target[start:end], rows[start:end], ignore_index, grad,
                logit_scale, softcap,
            )  # fmt: skip
            # The padding's logits are 0 (zero rows of the weight) and stay as they are:
            # they add nothing to the input's gradient and fill only padding's gradient.
            if grad_x is not None:
                torch.mm(logits, w, out=grad_x[start:end])
            if grad_w is not None:
                _accumulate_mm(grad_w, logits.t(), xc)
            if grad_b is not None:
                grad_b.add_(logits[:, :v].float().sum(0))
        if grad_w is not None:
            grad_w = grad_w[:v]
        loss = rows.sum() * scale
        # Held on ctx, not saved for backward: they are ours (no version to check) and
        # the backward hands them on.
        ctx.saved_grads = (grad_x, grad_w, grad_b, scale)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.weight = targeted(weight)  # where its gradient goes, if anywhere
        return loss

    @staticmethod
    @first_order("fused_linear_cross_entropy")
    def backward(ctx, grad_loss):
        if ctx.saved_grads is None:
            raise UnsupportedOperationError(
                "fused_linear_cross_entropy: a second backward through the same loss "
                "(retain_graph=True) is not supported: its gradients were formed in the "
                "forward and handed on by the first backward; compute the loss again"
            )
        grad_x, grad_w, grad_b, scale = ctx.saved_grads
        ctx.saved_grads = None
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        # The forward formed the gradients of the summed row losses, unscaled: 1/rows in
        # fp16 would push most softmax terms below fp16's normal range, and a loss scale
        # (GradScaler) only arrives now. Both scales are applied here, in fp32, on the
        # device (no sync). Where a gradient already has its parameter's dtype it is
        # scaled in place and handed on (autograd then keeps it as the .grad instead of
        # holding a second copy at the start of the backward, the step's peak), and the
        # buffers are dropped; a second backward through the graph (retain_graph) finds
        # none and says so. The weight's gradient is scaled into its target where it
        # has one (:mod:`._infra._grad_targets`).
        factor = grad_loss.float() * scale
        target = None if grad_w is None else gradient_target(ctx.weight, grad_w.shape, w_dtype)
        scaled = [
            None if g is None
            else torch.mul(g, factor, out=out) if out is not None
            else g.mul_(factor) if g.dtype == dtype
            else (g.float() * factor).to(dtype)
            for g, dtype, out in (
                (grad_x, x_dtype, None), (grad_w, w_dtype, target), (grad_b, b_dtype, None)
            )
        ]  # fmt: skip
        return *scaled, None, None, None, None, None, None


# -- the public entry -------------------------------------------------------------------------
def fused_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target)`` without the logits.

    Forward and backward run in chunks of rows (GEMMs by PyTorch, the softmax and its
    gradient by our Triton kernel, fp32 arithmetic and accumulation). Under autocast the
    projection runs in the autocast dtype, as ``F.linear`` would; the loss is fp32.

    Parameters
    ----------
    input : Tensor (..., H)
        Hidden states; fp32, fp16 or bf16.
    weight : Tensor (V, H)
        The output projection (the LM head), same dtype as ``input`` outside autocast.
    target : Tensor (...)
        Class indices (integer), the leading shape of ``input``.
    bias : Tensor (V,), optional
    ignore_index : int
        Rows with this target add nothing to the loss or the gradients. Any other target
        outside ``[0, V)`` makes the loss NaN (checking it on the host would cost a sync
        per step).
    reduction : {'mean', 'sum'}
        ``'mean'`` divides by the number of rows not ignored.
    scale : float
        Each logit is multiplied by it before the loss (Granite's ``1 / logits_scaling``,
        Cohere's ``logit_scale``); finite and not 0.
    softcap : float, optional
        Each (scaled) logit ``z`` is then taken as ``softcap * tanh(z / softcap)``
        (Gemma 2's ``final_logit_softcapping``); positive and finite.

    Returns
    -------
    Tensor
        The scalar loss (fp32).

    Raises
    ------
    InvalidInputError
        Shapes, dtypes or devices that do not match (the message says which).
    UnsupportedOperationError, BackendUnavailableError
        Another reduction, or a device Triton does not run on.

    Examples
    --------
    >>> loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, targets)  # doctest: +SKIP
    """
    _check(input, weight, target, bias, reduction)
    _check_transform(scale, softcap)
    require_triton("fused_linear_cross_entropy", input, weight, target,
                   *(() if bias is None else (bias,)))  # fmt: skip
    device_type = input.device.type
    dtype = autocast_dtype(device_type)
    if dtype is not None:
        input, weight = input.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    x = input.reshape(-1, input.shape[-1])
    t = target.reshape(-1)
    weight_grad = weight.requires_grad and torch.is_grad_enabled()
    chunk = chunk_rows(x.shape[0], weight.shape[0], x.shape[1], x.element_size(), weight_grad)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(
            x, weight, bias, t, ignore_index, reduction, chunk, float(scale),
            None if softcap is None else float(softcap),
        )  # fmt: skip


def _check_transform(scale, softcap) -> None:
    what = "fused_linear_cross_entropy"
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not (math.isfinite(scale) and scale != 0)
    ):
        raise InvalidInputError(f"{what}: scale must be a finite, non-zero number, got {scale!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float))
        or not (math.isfinite(softcap) and softcap > 0)
    ):  # fmt: skip
        raise InvalidInputError(
            f"{what}: softcap must be a positive, finite number or None, got {softcap!r}"
        )


def _check(input, weight, target, bias, reduction) -> None:
    what = "fused_linear_cross_entropy"
    for name, t in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise InvalidInputError(f"{what}: {name} must be a Tensor, got {type(t).__name__}")
    if reduction not in _REDUCTIONS:
        raise UnsupportedOperationError(
            f"{what}: reduction {reduction!r} is not fused (the gradients are formed in "
            f"the forward, which needs a scalar loss); expected one of {list(_REDUCTIONS)}"
        )
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise InvalidInputError(
            f"{what}: input (..., H) and weight (V, H) must agree on H; got input "
            f"{tuple(input.shape)} and weight {tuple(weight.shape)}"
        )
    if target.shape != input.shape[:-1]:
        raise InvalidInputError(
            f"{what}: target must have the leading shape of input, {tuple(input.shape[:-1])}; "
            f"got {tuple(target.shape)}"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise InvalidInputError(
            f"{what}: target must hold integer class indices, got {target.dtype}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise InvalidInputError(
            f"{what}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    for name, t in (("input", input), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"{what}: {name} must be fp32, fp16 or bf16, got {t.dtype}")
    check_matching_dtypes(what, input, weight)

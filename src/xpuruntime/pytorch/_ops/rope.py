r"""rope: rotary position embedding of queries and keys (Su et al., "RoFormer", 2021,
arXiv:2104.09864), as Llama-style models apply it.

Each head vector :math:`x` of width :math:`D` is split into pairs that rotate by the
position's angles: in the half-split layout (Llama, GPT-NeoX; transformers'
``rotate_half``) the pairs are :math:`(x_i, x_{i + D/2})`, in the interleaved layout
(GPT-J, RoFormer) :math:`(x_{2i}, x_{2i+1})`. With :math:`(c_1, c_2)` and
:math:`(s_1, s_2)` the cosines and sines at the pair's two places,

.. math::
    y_1 = x_1 c_1 - x_2 s_1,\qquad y_2 = x_2 c_2 + x_1 s_2,

and the backward is its transpose, :math:`\partial x_1 = \partial y_1 c_1 + \partial y_2
s_2`, :math:`\partial x_2 = \partial y_2 c_2 - \partial y_1 s_1`. One pass over q and one
over k each way, fp32 math, reading q and k in whatever layout the attention's
``transpose(1, 2)`` left them and writing the results in that layout; PyTorch's
expression runs six elementwise kernels per tensor each way and keeps ``cos`` and
``sin`` broadcast products for the backward.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import InvalidInputError
from ._infra._cached_launch import cached_launch
from ._infra._launch import FLOAT_DTYPES, cdiv, triton_or_fallback
from ._infra._op import kernel_op

__all__ = ["check_rope", "rope", "run_rope", "torch_rope"]


# -- kernel ----------------------------------------------------------------------------------
@cached_launch
@triton.jit
def _rope_kernel(
    x_ptr,  # (B, H, T, D), any strides but a unit last one
    cos_ptr,  # (B or 1, T, D), unit last stride
    sin_ptr,  # same strides as cos
    y_ptr,  # (B, H, T, D), unit last stride
    H,
    T,
    HALF,
    sxb,
    sxh,
    sxt,
    syb,
    syh,
    syt,
    scb,
    sct,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    t = (tl.program_id(1) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (t < T) & (i < HALF)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    x = x_ptr + b * sxb + h * sxh + t * sxt
    x1 = tl.load(x + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + second, mask=mask, other=0.0).to(tl.float32)
    at = b * scb + t * sct
    c1 = tl.load(cos_ptr + at + first, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + at + second, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + at + first, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + at + second, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: y1 = x1 c1 + x2 s2, y2 = x2 c2 - x1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y = y_ptr + b * syb + h * syh + t * syt
    tl.store(y + first, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y + second, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool) -> Tensor:
    """``x`` (B, H, T, D) rotated by ``cos``/``sin`` (B or 1, T, D), in ``x``'s layout."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)  # keeps x's (permuted) layout
    batch, heads, length, width = x.shape
    if not y.numel():
        return y
    half = width // 2
    block = triton.next_power_of_2(half)
    rows = max(1, min(64, 2048 // block))
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    grid = (batch * heads, cdiv(length, rows))
    _rope_kernel[grid](
        x, cos, sin, y, heads, length, half,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        scb, cos.stride(1),
        ROWS=rows, BLOCK=block, INTERLEAVED=interleaved, BACKWARD=backward, num_warps=4,
    )  # fmt: skip
    return y


# -- launchers -------------------------------------------------------------------------------
def _forward(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    return _rotate(q, cos, sin, interleaved, False), _rotate(k, cos, sin, interleaved, False)


def _backward(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    return _rotate(dq, cos, sin, interleaved, True), _rotate(dk, cos, sin, interleaved, True)


def _fake(a: Tensor, b: Tensor, *angles_and_layout: object) -> tuple[Tensor, Tensor]:
    """Either direction's outputs: shaped and laid out as its two tensors."""
    return torch.empty_like(a), torch.empty_like(b)


def _prepare(saved: tuple, state: tuple, dq: Tensor | None, dk: Tensor | None) -> tuple:
    cos, sin = saved
    q_like, k_like, interleaved = state
    dq = torch.zeros(q_like[0], dtype=q_like[1], device=cos.device) if dq is None else dq
    dk = torch.zeros(k_like[0], dtype=k_like[1], device=cos.device) if dk is None else dk
    return dq, dk, cos, sin, interleaved


_rope = kernel_op(
    "rope",
    forward=_forward,
    forward_fake=_fake,
    backward=_backward,
    backward_fake=_fake,
    save=lambda inputs, outputs: (
        inputs[2:4],
        ((inputs[0].shape, inputs[0].dtype), (inputs[1].shape, inputs[1].dtype), inputs[4]),
    ),
    prepare=_prepare,
    finish=lambda state, grads: (grads[0], grads[1], None, None, None),
    outputs=2,
)


# -- the op ----------------------------------------------------------------------------------
def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: Tensor) -> Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def torch_rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """PyTorch's expression of the op (transformers' ``apply_rotary_pos_emb`` for the
    half-split layout, with ``unsqueeze_dim=1``)."""
    rotate = _rotate_pairs if interleaved else _rotate_half
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def run_rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`rope` on arguments already checked (the routed op's call path)."""
    if sin.dtype != cos.dtype:
        sin = sin.to(cos.dtype)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return _rope(q, k, cos, sin, bool(interleaved))


def check_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> None:
    """Raise :class:`~xpuruntime.InvalidInputError` unless ``q`` (B, H, T, D) and ``k``
    (B, Hk, T, D) are float tensors of one dtype and device with an even ``D``, and
    ``cos``/``sin`` are (B or 1, T, D), without gradients of their own."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise InvalidInputError(f"rope: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4:
        raise InvalidInputError(
            f"rope: q and k must be (batch, heads, tokens, head_dim), got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    batch, _, length, width = q.shape
    if k.shape[0] != batch or k.shape[2:] != q.shape[2:] or width % 2:
        raise InvalidInputError(
            f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, tokens and "
            "an even head_dim"
        )
    expected = (length, width)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[1:] != expected or t.shape[0] not in (1, batch):
            raise InvalidInputError(
                f"rope: {name} must be ({batch} or 1, {length}, {width}), got {tuple(t.shape)}"
            )
        if t.requires_grad and torch.is_grad_enabled():
            raise InvalidInputError(f"rope: {name} requires a gradient, which rope does not give")
    if q.dtype != k.dtype or q.dtype not in FLOAT_DTYPES:
        raise InvalidInputError(
            f"rope: q and k must share a dtype of fp32, fp16 or bf16, got {q.dtype} and {k.dtype}"
        )
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise InvalidInputError(f"rope: tensors on several devices {sorted(map(str, devices))}")


def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one Triton pass each, forward and
    backward.

    Parameters
    ----------
    q, k : Tensor
        (batch, heads, tokens, head_dim) and (batch, kv_heads, tokens, head_dim), fp32,
        fp16 or bf16, any strides (transposed views are read in place).
    cos, sin : Tensor
        (batch or 1, tokens, head_dim): the angles per position, as transformers'
        rotary embedding module returns them (no gradient flows into them).
    interleaved : bool
        Pairs ``(x[2i], x[2i+1])`` (GPT-J) instead of ``(x[i], x[i + D/2])`` (Llama).

    Returns
    -------
    tuple of Tensor
        The rotated q and k, in their shapes, dtypes and layouts (computed in fp32 from
        the angles in their own precision: transformers' fp32 angles under autocast are
        not rounded to bf16 first).

    Raises
    ------
    InvalidInputError
        Shapes, dtypes or devices that do not fit, or ``cos``/``sin`` needing a gradient.
    UnsupportedOperationError, BackendUnavailableError
        Under a strict kernel policy, where Triton cannot run on the tensors' device;
        otherwise PyTorch's expression runs after a ``FallbackWarning``.
    """
    check_rope(q, k, cos, sin, interleaved)
    if not triton_or_fallback("rope", q, k):
        return torch_rope(q, k, cos, sin, interleaved)
    return run_rope(q, k, cos, sin, interleaved)

"""Rows: what the norm ops share. Their inputs are walked as dense (rows, N) matrices
of the trailing ``normalized_shape`` dims; these helpers check the arguments once, shape
them as rows, and say whether a call needs autograd."""

import numbers

import torch
from torch import Tensor

from ...._errors import InvalidInputError
from ._launch import FLOAT_DTYPES, MAX_ROW_BLOCK, require_triton

__all__ = [
    "as_grouped_rows",
    "as_rows",
    "check_norm_args",
    "check_residual_args",
    "normalized",
    "output_dtype",
    "param_row",
    "params_grad_dtype",
    "trained_dtypes",
    "residual_grads",
    "wants_grad",
]

_grad_enabled = torch.is_grad_enabled


def as_rows(input: Tensor, n: int) -> Tensor:
    """``input`` as dense (rows, n) rows (a view when its layout allows)."""
    return input.reshape(-1, n).contiguous()  # itself where it is dense


def as_grouped_rows(input: Tensor, n: int) -> Tensor:
    """``input`` as :func:`as_rows` gives it, except where that would copy rows of at
    most :data:`MAX_ROW_BLOCK` that a view reaches as grouped rows, (M / H, H, n) or
    (M / (G * H), G, H, n): rows evenly strided within the last dimension but one (and
    the one before it), the groups evenly strided. A per-head view of wider rows is one:
    the queries sliced from one projection of q, k and v, before attention's transpose
    (Qwen3's q/k norms) or after it (Gemma3's). A kernel taking grouped rows reads them
    in place."""
    if (
        input.dim() < 3
        or input.is_contiguous()
        or input.stride(-1) != 1
        or input.shape[-1] != n
        or n > MAX_ROW_BLOCK
        or not input.numel()
    ):
        return as_rows(input, n)
    for levels in (1, 2):  # the last dim but one, then the two before the last
        if input.dim() >= levels + 2:
            try:
                return input.view(-1, *input.shape[-1 - levels : -1], n)
            except RuntimeError:  # the dims before them are not one evenly strided run
                pass
    return as_rows(input, n)


def param_row(param: Tensor | None, n: int) -> Tensor | None:
    """A norm's parameter as a dense (n,) row (itself when it is one already)."""
    if param is None or (param.dim() == 1 and param.is_contiguous()):
        return param
    return param.reshape(n).contiguous()


def params_grad_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """The dtype a norm's parameter gradients are summed into (in fp32, then written
    once): the parameters' own when they share one (None: no such parameter), else fp32."""
    present = {d for d in dtypes if d is not None}
    return present.pop() if len(present) == 1 else torch.float32


def trained_dtypes(*params: Tensor | None) -> tuple[torch.dtype | None, ...]:
    """Each norm parameter's dtype where its gradient is computed; None where there is
    no such parameter or it is frozen (a LoRA base's: no gradient is summed for it)."""
    return tuple(None if p is None or not p.requires_grad else p.dtype for p in params)


def wants_grad(*args: object) -> bool:
    """Whether autograd must record a call on ``args`` (tensors among other arguments)."""
    return _grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in args)


def output_dtype(op: str, input: Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None:
        return input.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise InvalidInputError(
            f"{op}: out_dtype must be torch.float32, float16 or bfloat16, got {out_dtype!r}"
        )
    return out_dtype


def normalized(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    try:
        if isinstance(normalized_shape, (str, bytes)) or not all(
            isinstance(d, numbers.Integral) for d in normalized_shape
        ):
            raise TypeError
        shape = tuple(int(d) for d in normalized_shape)
    except TypeError:
        raise InvalidInputError(
            f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        ) from None
    if not shape or any(d < 1 for d in shape):
        raise InvalidInputError(
            f"normalized_shape must be non-empty with every size >= 1, got {shape}"
        )
    return shape


def check_norm_args(op: str, input, shape: tuple[int, ...], params) -> None:
    if not isinstance(input, Tensor):
        raise InvalidInputError(f"{op}: input must be a tensor, got {type(input).__name__}")
    if input.dtype not in FLOAT_DTYPES:
        raise InvalidInputError(
            f"{op}: input dtype must be float32, float16 or bfloat16, got {input.dtype}"
        )
    if tuple(input.shape[input.dim() - len(shape) :]) != shape or input.dim() < len(shape):
        raise InvalidInputError(
            f"{op}: input of shape {tuple(input.shape)} does not end with the "
            f"normalized_shape {shape}"
        )
    for name, p in params:
        if p is not None and (not isinstance(p, Tensor) or tuple(p.shape) != shape):
            got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise InvalidInputError(f"{op}: {name} must have shape {shape}, got {got}")


def check_residual_args(
    op: str, x, y, normalized_shape, params, out_dtype: torch.dtype | None
) -> tuple[tuple[int, ...], torch.dtype]:
    """Check a residual add-and-norm op's arguments (``x`` and ``y`` of one shape ending
    with ``normalized_shape``, the norm's ``params`` as ``(name, tensor or None)``, a
    device Triton runs on); return the normalized shape and the normed output's dtype
    (default: the sum's, PyTorch's promotion of ``x`` and ``y``)."""
    shape = normalized(normalized_shape)
    check_norm_args(op, x, shape, params)
    check_norm_args(op, y, shape, ())
    if x.shape != y.shape:
        raise InvalidInputError(
            f"{op}: x and y must have the same shape (no broadcasting), got "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    require_triton(op, x, y, *(t for _, t in params if t is not None))
    if out_dtype is None:
        return shape, torch.promote_types(x.dtype, y.dtype)
    return shape, output_dtype(op, x, out_dtype)


def residual_grads(h: Tensor, dh: Tensor | None, dn: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A residual add-and-norm backward's incoming gradients, dense: the normed output's
    (zeros where nothing used it) and the sum's (None where nothing used it)."""
    dn = torch.zeros_like(h) if dn is None else dn.contiguous()
    return dn, None if dh is None else dh.contiguous()

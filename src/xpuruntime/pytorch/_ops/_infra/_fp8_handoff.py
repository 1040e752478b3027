"""Per-token FP8 work an op hands to the next, so that a tensor is not read again for it.

A LoRA op over a base stored in FP8 casts its input per token to e4m3, and in its
backward the output gradient times the base's row scales (:func:`..fp8.stored_output_gemm`,
:func:`..fp8.stored_input_grad_gemm`). Each cast reads its tensor twice: once for each
row's amax, once to cast. In Llama-8B's gated MLP the two casts around the activation
took 0.27 ms a layer at 4096 tokens on an H200 (``h``'s 79 us, the gate/up gradient's
195). The activation between the two projections already passes over both tensors, so
it does the work instead:

- forward: the activation kept in FP8 (:func:`..swiglu.run_fp8_kept`) writes ``h``'s
  per-token cast beside ``h`` (:func:`hand_cast`); the down projection reads it
  (:func:`handed_cast`) and does not cast ``h``.
- backward: the gate/up projection marks its output with the scales its backward will
  multiply the output gradient by (:func:`mark_gradient_scales`). The activation's
  backward finds each row's amax of its gradient times them as it writes the gradient,
  in parts, one per block of columns (:func:`hand_amax`). The projection's cast then
  reads the gradient once (:func:`handed_amax`).

Each handed value is keyed on what changes it: the tensor's version counter (an in-place
write after it was made refuses it), its shape, and for an amax the scales' storage,
size and version. A value that does not match is not used: the op casts as it would
have. Like :mod:`._recompute`'s marks, these are attributes, set only outside a trace
(and a forward's only while autograd records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "gradient_scales",
    "hand_amax",
    "hand_cast",
    "handed_amax",
    "handed_cast",
    "mark_gradient_scales",
]

_CAST = "_xpuruntime_fp8_cast"
_AMAX = "_xpuruntime_fp8_amax"
_SCALES = "_xpuruntime_fp8_grad_scales"


class _Cast(NamedTuple):
    qdata: Tensor  # (rows, columns) e4m3
    inverse: Tensor  # fp32 (rows, 1): each row's amax / 448
    version: int
    shape: torch.Size


class _Amax(NamedTuple):
    parts: Tensor  # fp32 (rows, parts): each row's amax in parts
    version: int
    shape: torch.Size
    scales: tuple[int, int, int]  # the scales' data pointer, size and version


def _scales_key(scales: Tensor) -> tuple[int, int, int]:
    return scales.data_ptr(), scales.numel(), scales._version


def hand_cast(tensor: Tensor, qdata: Tensor, inverse: Tensor) -> None:
    """Say that ``qdata`` (e4m3, a row per token) and ``inverse`` (fp32 (rows, 1)) are
    ``tensor``'s per-token cast, as :func:`..fp8.quantize` (``per="row"``) makes it
    (while autograd records, outside a trace)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        setattr(tensor, _CAST, _Cast(qdata, inverse, tensor._version, tensor.shape))


def handed_cast(tensor: Tensor) -> tuple[Tensor, Tensor] | None:
    """``tensor``'s per-token cast ``(qdata, inverse)`` handed by its maker, or None
    (none handed, or ``tensor`` written since)."""
    cast = getattr(tensor, _CAST, None)
    if cast is None or cast.version != tensor._version or cast.shape != tensor.shape:
        return None
    return cast.qdata, cast.inverse


def mark_gradient_scales(output: Tensor, scales: Callable[[], Tensor]) -> None:
    """Say that ``output``'s backward casts its gradient per token after multiplying
    each column by ``scales()`` (fp32, one per column; called in the backward, where
    the scales are at hand again: FSDP2 gathers them anew)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        setattr(output, _SCALES, scales)


def gradient_scales(output: Tensor) -> Callable[[], Tensor] | None:
    """What :func:`mark_gradient_scales` said of ``output``, or None."""
    return getattr(output, _SCALES, None)


def hand_amax(grad: Tensor, parts: Tensor, scales: Tensor) -> None:
    """Say that ``parts`` (fp32 (rows, P)) hold each row's largest magnitude of ``grad``
    times ``scales``, column by column, in P parts (outside a trace)."""
    if not torch.compiler.is_compiling():
        setattr(grad, _AMAX, _Amax(parts, grad._version, grad.shape, _scales_key(scales)))


def handed_amax(grad: Tensor, scales: Tensor) -> Tensor | None:
    """The parts of each row's amax of ``grad`` times ``scales`` handed by ``grad``'s
    maker, or None (none handed, other scales, or either written since)."""
    handed = getattr(grad, _AMAX, None)
    if (
        handed is None
        or handed.version != grad._version
        or handed.shape != grad.shape
        or handed.scales != _scales_key(scales)
    ):
        return None
    return handed.parts

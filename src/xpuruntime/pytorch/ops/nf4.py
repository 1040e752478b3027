r"""dequantize_4bit: bitsandbytes' 4-bit weights (QLoRA's nf4 base, or fp4) made dense
by one Triton pass that reads bitsandbytes' own storage.

A ``Params4bit`` holds two codes per byte (the first element in the high nibble), a
scale per block of ``blocksize`` elements, and the 16-entry code table:

.. math::
    w_i = \mathrm{code}_4[q_i]\; a_{\lfloor i / b \rfloor}

With double quantization (QLoRA's ``bnb_4bit_use_double_quant``, bitsandbytes'
``compress_statistics``) the scales are themselves stored as bytes of an 8-bit code,
with a scale per block of 256 of them and an offset:
:math:`a_j = \mathrm{code}_8[s_j]\, a'_{\lfloor j / 256 \rfloor} + o`. The arithmetic is
bitsandbytes' (fp32, then the weight's dtype, rounded to nearest), so the result is the
same to the bit, but that a GPU fuses a double-quantized scale's multiply and add (one
rounding where bitsandbytes' two kernels make two): fp32 weights then differ by at most
an ulp (seen on an H200), half-precision ones only where that ulp decides a rounding.

Why a pass of our own: ``bitsandbytes.functional.dequantize_4bit`` costs host time per
call (the scales dequantized by one op, the offset added by another, allocations, its
Python), and QLoRA makes the base dense twice per layer and step (forward, backward);
in a plain loop that host time is what the step waits for (Tim Dettmers et al., "QLoRA"
(2023, arXiv:2305.14314)). Here a weight is one launch, written straight into a slice of
a caller's buffer (the joined q/k/v or gate/up weight, with no copy to join them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._errors import UnsupportedOperationError
from ._cached_launch import cached_launch
from ._launch import cdiv, triton_unavailable

__all__ = ["dequantize_4bit", "run_dequantize_4bit", "unsupported"]

_BLOCK = 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@cached_launch
@triton.jit
def _dequantize_4bit(
    packed_ptr,  # (ceil(n / 2),) uint8: two codes a byte, the first in the high nibble
    code_ptr,  # (16,) fp32: the 4-bit code table (nf4 or fp4)
    absmax_ptr,  # (ceil(n / blocksize),) fp32 scales; nested: uint8 codes of them
    code8_ptr,  # (256,) fp32: nested, the scales' 8-bit code table
    absmax2_ptr,  # (ceil(blocks / blocksize2),) fp32: nested, the scales' own scales
    out_ptr,  # (n,) the dense weight (a slice of a joined one), contiguous
    offset_ptr,  # (1,) fp32: nested, added to every scale
    n,
    blocksize,
    blocksize2,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
    nibble = (byte >> ((1 - offs % 2) * 4)) & 0xF
    value = tl.load(code_ptr + nibble, mask=mask, other=0.0)
    block = offs // blocksize
    if NESTED:
        quantized = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code8_ptr + quantized, mask=mask, other=0.0)
        scale = scale * tl.load(absmax2_ptr + block // blocksize2, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    dense = value * scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # Rounded to nearest even by hand, so that the conversion below only drops zero
        # bits: Triton's interpreter truncates where compiled code rounds.
        bits = dense.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        dense = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, dense.to(out_ptr.dtype.element_ty), mask=mask)


def unsupported(packed: Tensor, state: object, out: Tensor | None = None) -> str | None:
    """Why :func:`dequantize_4bit` cannot make this weight (into ``out``, where given:
    None where it can)."""
    why = triton_unavailable(packed.device)
    if why is not None:
        return why
    if torch.compiler.is_compiling():
        return "under torch.compile, which traces bitsandbytes' registered op instead"
    if getattr(state, "packing_format_for_cpu", False):
        return "bitsandbytes repacked the weight for its CPU kernels"
    if state.quant_type not in ("nf4", "fp4"):
        return f"quant_type {state.quant_type!r} (nf4 or fp4 are read)"
    if state.nested and (state.state2.absmax.dtype != torch.float32):
        return "nested scales whose own scales are not fp32"
    if out is None:
        return None
    if out.dtype not in _DTYPES or not out.is_contiguous():
        return "the output must be a contiguous fp16, bf16 or fp32 tensor"
    if packed.device != out.device or out.numel() != _numel(state.shape):
        return "the output must be on the weight's device, of its size"
    return None


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def dequantize_4bit(packed: Tensor, state: object, out: Tensor) -> Tensor:
    """bitsandbytes' 4-bit weight ``packed`` (a ``Params4bit``'s data) with its
    ``QuantState``, made dense into ``out`` (its shape's numel, any float dtype).

    Parameters
    ----------
    packed : Tensor
        The packed codes (uint8, or a ``quant_storage`` dtype viewed as bytes).
    state : bitsandbytes.functional.QuantState
        Its scales, code table, block size and shape; nested (double-quantized) or not.
    out : Tensor
        Where the dense weight goes: contiguous, ``state.shape``'s number of elements.

    Returns
    -------
    Tensor
        ``out``, holding what ``bitsandbytes.functional.dequantize_4bit`` computes.

    Raises
    ------
    UnsupportedOperationError
        :func:`unsupported` says why (the caller then runs bitsandbytes' own).
    """
    why = unsupported(packed, state, out)
    if why is not None:
        raise UnsupportedOperationError(f"dequantize_4bit: {why}")
    return run_dequantize_4bit(packed, state, out)


def run_dequantize_4bit(packed: Tensor, state: object, out: Tensor) -> Tensor:
    """:func:`dequantize_4bit` where :func:`unsupported` has said None (the QLoRA op's
    call path: checked once, not twice)."""
    n = out.numel()
    if n == 0:
        return out
    codes = packed.reshape(-1).view(torch.uint8)
    table = state.code.to(packed.device, torch.float32)
    if state.nested:  # the offset read on the device: no wait for the GPU
        inner = state.state2
        absmax, code8, absmax2, blocksize2 = state.absmax, inner.code, inner.absmax, inner.blocksize
        offset = torch.as_tensor(state.offset, dtype=torch.float32, device=packed.device)
    else:
        absmax, code8, absmax2, blocksize2, offset = state.absmax, table, table, 1, table
    _dequantize_4bit[(cdiv(n, _BLOCK),)](
        codes, table, absmax, code8, absmax2, out, offset, n, state.blocksize, blocksize2,
        NESTED=bool(state.nested), BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return out

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
(2023, arXiv:2305.14314)). Here a LoRA group's weights (q/k/v, gate/up) are one launch,
written straight into the joined weight's rows, with the launch's arguments kept from
call to call (:func:`joined_4bit`).

Under ``precision="fp8"`` a group's 4-bit weights are made FP8 instead of bf16
(:func:`fp8_4bit`): each row in e4m3 with one fp32 scale. The ``lora_linear`` op's FP8
GEMMs read that as they read a base stored in FP8 (:mod:`._infra._fp8_weight`). A row's
scale is its blocks' largest scale times the code table's largest magnitude, over
e4m3's largest value, so every value of the row fits. For nf4 it is the row's amax
exactly: the table holds -1 and 1, the codes a block's largest magnitude is stored as.
The scales are found once per group and kept. The bf16 pass writes the values in an
FP8 mode, in rows (the forward GEMM's layout); the input gradient's columns are those
rows transposed after. On an H200 (2026-11-30, ``bench_nf4.py``) that beat Triton tiles
writing either layout straight. It was 2.2x faster for the rows, 1.5x for the columns
with their transpose. Tiles read a row's bytes in short pieces at 146-254 registers a
thread; a flat block reads 512 bytes in a row at 80. In Llama-3B's QLoRA step the tiles
took 260 ms, the flat pass 205.
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..._errors import UnsupportedOperationError
from ._infra._cached_launch import cached_launch
from ._infra._capture_paths import capture_paths
from ._infra._launch import cdiv, triton_unavailable
from .fp8 import E4M3, cast_constants, scaled_to_grid, transposed

__all__ = [
    "dequantize_4bit",
    "fp8_4bit",
    "fp8_4bit_scales",
    "fp8_4bit_unsupported",
    "joined_4bit",
    "run_dequantize_4bit",
    "unsupported",
]

_BLOCK = 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dense(packed_ptr, code_ptr, absmax_ptr, code8_ptr, absmax2_ptr, offset_ptr, offs, block,
           outer, mask, NESTED: tl.constexpr):  # fmt: skip
    """The weight's values at element indices ``offs`` (fp32), each of scale ``block``
    (nested: that scale's own scale ``outer``)."""
    byte = tl.load(packed_ptr + (offs >> 1), mask=mask, other=0).to(tl.int32)
    nibble = (byte >> ((1 - (offs & 1)) * 4)) & 0xF  # (offs >= 0: shifts, not divisions)
    value = tl.load(code_ptr + nibble, mask=mask, other=0.0)
    if NESTED:
        quantized = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code8_ptr + quantized, mask=mask, other=0.0)
        scale = scale * tl.load(absmax2_ptr + outer, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return value * scale


@triton.jit
def _write_part(
    out_ptr,  # where the part's first element goes
    packed_ptr,  # (ceil(n / 2),) uint8: two codes a byte, the first in the high nibble
    code_ptr,  # (16,) fp32: the 4-bit code table (nf4 or fp4)
    absmax_ptr,  # (ceil(n / blocksize),) fp32 scales; nested: uint8 codes of them
    code8_ptr,  # (256,) fp32: nested, the scales' 8-bit code table
    absmax2_ptr,  # (ceil(blocks / blocksize2),) fp32: nested, the scales' own scales
    offset_ptr,  # (1,) fp32: nested, added to every scale
    factor_ptr,  # FP8: fp32, what each of the part's rows is multiplied by (448 / amax)
    program,  # this program's block of the part
    n,
    K,  # FP8: the elements of a row
    blocksize,
    blocksize2,
    NESTED: tl.constexpr,
    FP8: tl.constexpr,  # written in e4m3 by the rows' factors, not in the output's dtype
    FMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    TINY: tl.constexpr,
    SPACING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = program * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    block = offs // blocksize
    dense = _dense(packed_ptr, code_ptr, absmax_ptr, code8_ptr, absmax2_ptr, offset_ptr, offs,
                   block, block // blocksize2, mask, NESTED)  # fmt: skip
    if FP8:
        factor = tl.load(factor_ptr + offs // K, mask=mask, other=1.0)
        dense = scaled_to_grid(dense, factor, FMAX, MANTISSA, TINY, SPACING)
    elif out_ptr.dtype.element_ty == tl.bfloat16:
        # Rounded to nearest even by hand, so that the conversion below only drops zero
        # bits: Triton's interpreter truncates where compiled code rounds.
        bits = dense.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        dense = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, dense.to(out_ptr.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _dequantize_4bit(
    out_ptr,  # the parts' dense weights one after the other, contiguous
    factor_ptr,  # FP8: fp32 (rows,), each row's 448 / amax (else any pointer, unread)
    code_ptr,
    code8_ptr,
    K,  # FP8: a row's elements (else 1)
    blocksize,
    blocksize2,
    packed0, absmax0, absmax2_0, offset0, n0,  # a part: as _write_part's
    packed1, absmax1, absmax2_1, offset1, n1,
    packed2, absmax2, absmax2_2, offset2, n2,
    NESTED: tl.constexpr,
    PARTS: tl.constexpr,  # 1 to 3; the unused parts' arguments repeat the first's
    FP8: tl.constexpr,
    FMAX: tl.constexpr,
    MANTISSA: tl.constexpr,
    TINY: tl.constexpr,
    SPACING: tl.constexpr,
    EPS: tl.constexpr,  # (cast_constants' own, unread: the amax is clamped where found)
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks0 = tl.cdiv(n0, BLOCK)
    blocks1 = tl.cdiv(n1, BLOCK)
    if pid < blocks0:
        _write_part(out_ptr, packed0, code_ptr, absmax0, code8_ptr, absmax2_0, offset0,
                    factor_ptr, pid, n0, K, blocksize, blocksize2, NESTED, FP8, FMAX,
                    MANTISSA, TINY, SPACING, BLOCK)  # fmt: skip
    elif PARTS == 2 or pid < blocks0 + blocks1:
        _write_part(out_ptr + n0, packed1, code_ptr, absmax1, code8_ptr, absmax2_1, offset1,
                    factor_ptr + n0 // K, pid - blocks0, n1, K, blocksize, blocksize2,
                    NESTED, FP8, FMAX, MANTISSA, TINY, SPACING, BLOCK)  # fmt: skip
    else:
        _write_part(out_ptr + n0 + n1, packed2, code_ptr, absmax2, code8_ptr, absmax2_2,
                    offset2, factor_ptr + (n0 + n1) // K, pid - blocks0 - blocks1, n2, K,
                    blocksize, blocksize2, NESTED, FP8, FMAX, MANTISSA, TINY, SPACING,
                    BLOCK)  # fmt: skip


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
    if _numel(state.shape) >= 2**31:
        return "a weight of 2**31 elements or more (the pass indexes a weight in 32 bits)"
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
    if out.numel() == 0:
        return out
    shared, part = _arguments(packed, state)
    _launch(out, shared, (part,))
    return out


def joined_4bit(weights: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor | None:
    """bitsandbytes 4-bit weights (``Params4bit``: a LoRA group's q/k/v, or gate/up) made
    dense and joined by rows in ``dtype``, by one launch; None where this pass cannot
    (the caller then makes each by bitsandbytes' or :func:`dequantize_4bit`).

    ``dtype`` is the weights' own (their quantization state's). Where they were quantized
    from fp32 (a model loaded in fp32, computing in bf16), it is any of fp16, bf16, fp32.
    The pass rounds its fp32 product once to ``dtype``. That is bitsandbytes' fp32
    weight cast, to the bit, with no fp32 weight written and read. (A half-precision
    state made in another dtype would take two roundings: not this pass.)

    What a launch needs (the parts' storage, scales and tables) is kept from call to call
    while the weights are the same objects holding the same storage and quantization
    state: QLoRA makes every base weight dense twice per step, and without a graph the
    step waits for that host work (checks, bitsandbytes' tensor subclass, one launch per
    weight), not for the GPU.
    """
    if torch.compiler.is_compiling():
        return None
    plan = _plan(weights)
    if plan is None or not _rounds_once(plan.dtype, dtype):
        return None
    out = torch.empty(plan.shape, dtype=dtype, device=plan.device)
    if out.numel():
        _dequantize_4bit.launch(plan.grid, (out, *plan.args), plan.options, plan.rest)
    return out


def _rounds_once(state: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the pass writing a weight of the ``state`` dtype in ``dtype`` gives
    bitsandbytes' dense weight cast to it: its own dtype, or any from fp32."""
    return dtype == state or (state == torch.float32 and dtype in _DTYPES)


def fp8_4bit_unsupported(weights: tuple[Tensor, ...]) -> str | None:
    """Why :func:`fp8_4bit` cannot make these 4-bit weights FP8 (None where it can)."""
    return _fp8_plan(weights)[1]


def _fp8_plan(weights: tuple[Tensor, ...]) -> tuple[_Plan | None, str | None]:
    """The kept plan of ``weights`` and why the FP8 pass cannot make them (None: it can),
    by one look-up (each call of the op makes its group FP8 once)."""
    if torch.compiler.is_compiling():
        return None, "under torch.compile, which traces bitsandbytes' registered op instead"
    plan = _plan(weights)
    if plan is None:
        why = next((unsupported(w.data, w.quant_state) for w in weights
                    if getattr(w, "quant_state", None) is not None), None)  # fmt: skip
        return None, why or (
            "the weights are not 1 to 3 bitsandbytes 4-bit weights of one form and width, "
            "fewer than 2**31 elements in all"
        )
    return plan, plan.fp8_refusal


def fp8_4bit(weights: tuple[Tensor, ...], columns: bool = False) -> tuple[Tensor, Tensor]:
    """A group of bitsandbytes 4-bit weights (as :func:`joined_4bit` takes them) made
    e4m3 by one launch, one fp32 scale per row: ``(values, scale)`` with the joined
    weight ``W ≈ diag(scale) values`` (``values`` (N, K) row-major; with ``columns``
    its (K, N) row-major transpose, what the input gradient's GEMM reads). The scales
    are found once and kept while the weights and their scales are unchanged.

    Raises
    ------
    UnsupportedOperationError
        :func:`fp8_4bit_unsupported` says why.
    """
    plan, why = _fp8_plan(weights)
    if why is not None:
        raise UnsupportedOperationError(f"fp8_4bit: {why}")
    scale, factor = plan.fp8_scales()
    out = torch.empty(plan.shape, dtype=E4M3, device=plan.device)
    if out.numel():
        grid, args, options, rest = plan.fp8_launch
        _dequantize_4bit.launch(grid, (out, factor, *args), options, rest)
    return (transposed(out) if columns else out), scale


def fp8_4bit_scales(weights: tuple[Tensor, ...]) -> Tensor:
    """The row scales :func:`fp8_4bit` makes these weights FP8 by (kept, not found
    again)."""
    return _plan(weights).fp8_scales()[0]


def _plan(weights: tuple[Tensor, ...]) -> _Plan | None:
    """The kept :class:`_Plan` of ``weights``, made where there is none (None where one
    launch cannot make them)."""
    plan = _plans.get(weights[0])
    if plan is None or not plan.holds(weights):
        plan = _Plan.of(weights)
        if plan is not None:
            _plans[weights[0]] = plan
    return plan


class _Plan:
    """The launch arguments of a group of 4-bit weights, with what they were read from."""

    def __init__(self, weights, states, pointers, shared, parts, shape, dtype, device):
        self.refs = tuple(weakref.ref(w) for w in weights)
        self.states, self.pointers = states, pointers
        self.shared, self.parts = shared, parts
        self.shape, self.dtype, self.device = shape, dtype, device
        # The launch's arguments after the output, and their part of its key, made once.
        self.grid, self.args, self.options = _launch_arguments(shared, parts)
        self.rest = _dequantize_4bit.rest_key(self.args, self.options)
        self.fp8_refusal = _fp8_refusal(shared[2], shape[1])
        self._fp8_scales: tuple | None = None  # (scale, factor, the scales' versions)

    @classmethod
    def of(cls, weights: tuple[Tensor, ...]) -> _Plan | None:
        """The plan for ``weights``, or None where one launch cannot make them."""
        if not 1 <= len(weights) <= 3:
            return None
        states = tuple(getattr(w, "quant_state", None) for w in weights)
        if any(
            s is None or not getattr(w, "bnb_quantized", False) for w, s in zip(weights, states)
        ):
            return None
        if len({_form(s) for s in states}) != 1:  # one launch reads them alike
            return None
        first = states[0]
        datas = tuple(w.data for w in weights)
        if any(unsupported(d, s) is not None for d, s in zip(datas, states)):
            return None
        arguments = [_arguments(d, s) for d, s in zip(datas, states)]
        shape = (sum(int(s.shape[0]) for s in states), int(first.shape[1]))
        if shape[0] * shape[1] >= 2**31:  # (the parts' offsets in the output are 32-bit)
            return None
        pointers = tuple(_storage(d, s) for d, s in zip(datas, states))
        parts = tuple(part for _, part in arguments)
        return cls(weights, states, pointers, arguments[0][0], parts, shape, first.dtype,
                   datas[0].device)  # fmt: skip

    def holds(self, weights: tuple[Tensor, ...]) -> bool:
        """Whether these are the weights it was made for, with the same storage and
        state (an in-place write to the storage is read by the launch as it is)."""
        if len(weights) != len(self.refs) or not all(
            r() is w and w.quant_state is s for r, w, s in zip(self.refs, weights, self.states)
        ):
            return False
        # Read past bitsandbytes' tensor subclass: its __torch_function__ would run for
        # each data_ptr() (a Python call per weight per call).
        with _plain_tensors():
            return all(_storage(w, s) == p for w, s, p in zip(weights, self.states, self.pointers))

    def fp8_scales(self) -> tuple[Tensor, Tensor]:
        """Each row's e4m3 scale (fp32 (N,): amax / 448, the amax its largest block scale
        times the code table's largest magnitude) and the factor its values are cast by
        (448 / amax), found once and kept while the parts' block scales are unwritten.
        Found while a CUDA graph is captured, they are not kept: the capture does not
        run the kernels that find them."""
        versions = tuple(_versions(s) for s in self.states)
        kept = self._fp8_scales
        if kept is not None and kept[2] == versions:
            return kept[0], kept[1]
        with torch.no_grad():
            width = self.shape[1]
            amax = torch.cat(
                [_row_amax(s, width, part[3]) for s, part in zip(self.states, self.parts)]
            )
            top = torch.finfo(E4M3).max
            scale, factor = amax / top, torch.full_like(amax, top) / amax
        if not capture_paths(self.device):
            self._fp8_scales = (scale, factor, versions)
        return scale, factor

    @functools.cached_property
    def fp8_launch(self) -> tuple:
        """The FP8 mode's grid, arguments after the output and the factors, options and
        their key (the factors, always a float32 tensor of PyTorch's allocator, left
        out of it)."""
        grid, args, options = _launch_arguments(self.shared, self.parts, self.shape[1])
        args = args[1:]  # (the factors are passed before them)
        return grid, args, options, _dequantize_4bit.rest_key(args, options)


def _fp8_refusal(blocksize: int, width: int) -> str | None:
    """Why the FP8 pass cannot make a group of these weights (None where it can)."""
    if width % blocksize:
        return (
            f"a row of {width} elements is not a whole number of bitsandbytes' blocks of "
            f"{blocksize} (each row's scale is found from its blocks')"
        )
    return None


def _versions(state: object) -> tuple[int, ...]:
    """The in-place write counts of a state's block scales (and theirs, nested)."""
    if state.nested:
        return state.absmax._version, state.state2.absmax._version
    return (state.absmax._version,)


def _row_amax(state: object, width: int, offset: Tensor) -> Tensor:
    """Each row's largest magnitude bound of a 4-bit weight (fp32 (rows,)): its blocks'
    largest scale times the code table's largest magnitude; rows of whole blocks.
    ``offset``: a nested state's, on the device (its launch argument: no host read)."""
    absmax = state.absmax
    if state.nested:  # code8[s] * absmax2[j // blocksize2] + offset, in fp32
        inner = state.state2
        blocks = absmax.numel()
        outer = inner.absmax.repeat_interleave(inner.blocksize)[:blocks]
        absmax = inner.code.to(absmax.device)[absmax.long()] * outer + offset
    rows = int(state.shape[0])
    top = state.code.to(absmax.device, torch.float32).abs().max()
    amax = absmax.float().abs().view(rows, width // state.blocksize).amax(1) * top
    return amax.clamp(min=cast_constants(E4M3)["EPS"])


_plans = WeakIdKeyDictionary()  # a group's first weight -> its _Plan


def _form(state: object) -> tuple:
    """What a launch reads alike for every weight of a group."""
    inner = state.state2.blocksize if state.nested else None
    return state.quant_type, bool(state.nested), state.blocksize, state.dtype, state.shape[1], inner


def _storage(packed: Tensor, state: object) -> tuple:
    """Where a weight's codes and scales live: a rebound ``.data`` or scale moves it."""
    nested = state.state2.absmax.data_ptr() if state.nested else None
    return packed.data_ptr(), state.absmax.data_ptr(), nested


def _arguments(packed: Tensor, state: object) -> tuple[tuple, tuple]:
    """A weight's launch arguments: those its group shares (the code tables, the block
    sizes, whether nested) and its own (codes, scales, offset, size)."""
    codes = packed.reshape(-1).view(torch.uint8)
    table = state.code.to(packed.device, torch.float32)
    if state.nested:  # the offset read on the device: no wait for the GPU
        inner = state.state2
        offset = torch.as_tensor(state.offset, dtype=torch.float32, device=packed.device)
        shared = (table, inner.code, state.blocksize, inner.blocksize, True)
        part = (codes, state.absmax, inner.absmax, offset, _numel(state.shape))
    else:
        shared = (table, table, state.blocksize, 1, False)
        part = (codes, state.absmax, table, table, _numel(state.shape))
    return shared, part


_plain_tensors = torch._C.DisableTorchFunctionSubclass


def _launch(out: Tensor, shared: tuple, parts: tuple[tuple, ...]) -> None:
    grid, args, options = _launch_arguments(shared, parts)
    _dequantize_4bit[grid](out, *args, **options)


def _launch_arguments(
    shared: tuple, parts: tuple[tuple, ...], fp8_width: int | None = None
) -> tuple[tuple, tuple, dict]:
    """The grid, the arguments after the output and the options of one launch making
    ``parts`` (1 to 3 weights) dense; with ``fp8_width`` (a row's elements) in e4m3 by
    the rows' factors, passed first (else the code table stands for them, unread)."""
    table, code8, blocksize, blocksize2, nested = shared
    blocks = sum(cdiv(part[-1], _BLOCK) for part in parts)
    padded = (*parts, *(parts[0],) * (3 - len(parts)))
    args = (table, table, code8, fp8_width or 1, blocksize, blocksize2, *padded[0],
            *padded[1], *padded[2])  # fmt: skip
    options = {"NESTED": nested, "PARTS": len(parts), "FP8": fp8_width is not None,
               **cast_constants(E4M3), "BLOCK": _BLOCK, "num_warps": 4}  # fmt: skip
    return (blocks,), args, options

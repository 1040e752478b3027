"""A LoRA group's adapters packed for the op's GEMMs in one launch.

The ``lora_linear`` op runs a group's adapters (q/k/v's, gate/up's) as two GEMMs. One
reads the A matrices joined by rows, ``[A_1; A_2; ...]``; the other the block diagonal
``diag(s_i B_i)``; both in the compute dtype. PyTorch makes them with a ``cat``, a
``new_zeros`` and a copy per adapter in every forward. That is five or six calls of
about 20 us of host time each on an H200 host, and a plain loop's forward waits for
them. :func:`pack_adapters` writes both in one Triton launch, each element cast (and
scaled) once, the off-diagonal blocks zeroed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._cached_launch import cached_launch
from ._launch import cdiv, interpreting, triton_unavailable

__all__ = ["pack_adapters"]

_BLOCK = 1024  # elements of the joined A per program
_ROWS = 32  # rows of the block diagonal per program
_MAX_RANK = 256  # the joined rank one program's row holds
_DTYPES = (torch.bfloat16, torch.float16)  # what the GEMMs run in under autocast
_SOURCES = (torch.float32, torch.bfloat16, torch.float16)  # read in fp32 without loss


def pack_adapters(
    lora_as: tuple[Tensor | None, ...],
    lora_bs: tuple[Tensor | None, ...],
    scales: tuple[float, ...],
    dtype: torch.dtype,
    sizes: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor] | None:
    """``(cat(lora_as), block_diag(s_i * lora_bs[i]))`` in ``dtype`` by one launch. Each
    element is read in fp32, scaled there and rounded once to nearest. A layer without
    an adapter (A and B None) adds no rows to the joined A and ``sizes[i]`` zero rows
    to the block diagonal (``sizes``: each layer's output width; by default each B's).

    None where the launch does not run; the caller then builds them with PyTorch:
    not 2 or 3 layers, none with an adapter, a joined rank over 256, a ``dtype`` other
    than bf16 or fp16, weights other than contiguous fp32, bf16 or fp16, no Triton for
    their device, a torch.compile trace, or bf16 under Triton's interpreter."""
    n = len(lora_as)
    if not 2 <= n <= 3 or dtype not in _DTYPES or torch.compiler.is_compiling():
        return None
    if dtype == torch.bfloat16 and interpreting():
        return None  # Triton's interpreter rounds to bf16 toward zero, not to nearest
    present = [i for i, a in enumerate(lora_as) if a is not None]
    if not present:
        return None
    first, first_b = lora_as[present[0]], lora_bs[present[0]]
    if triton_unavailable(first.device) is not None:
        return None
    ranks = tuple(0 if a is None else a.shape[0] for a in lora_as)
    total = sum(ranks)
    width = first.shape[1]
    if sizes is None:
        sizes = tuple(b.shape[0] for b in lora_bs)
    if total > _MAX_RANK:
        return None
    for a, b, rank, size in zip(lora_as, lora_bs, ranks, sizes):
        if a is None and b is None:
            continue
        if (
            a is None
            or b is None
            or a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != width
            or b.shape != (size, rank)
            or not a.is_contiguous()
            or not b.is_contiguous()
            or a.dtype not in _SOURCES
            or b.dtype not in _SOURCES
            or a.device != first.device
            or b.device != first.device
        ):
            return None
    a_out = torch.empty((total, width), dtype=dtype, device=first.device)
    diag = torch.empty((sum(sizes), total), dtype=dtype, device=first.device)
    a_programs = cdiv(total * width, _BLOCK)
    grid = (a_programs + cdiv(sum(sizes), _ROWS),)
    pad = 3 - n
    # (A layer without an adapter reads nothing: a rank of 0 masks every load; its
    # pointers stand in.)
    lora_as = tuple(first if a is None else a for a in lora_as)
    lora_bs = tuple(first_b if b is None else b for b in lora_bs)
    _pack[grid](
        a_out, diag, *lora_as, *(first,) * pad, *lora_bs, *(first_b,) * pad,
        *(float(s) for s in scales), *(1.0,) * pad, *ranks, *(0,) * pad, *sizes, *(0,) * pad,
        width, total, a_programs,
        PARTS=n, BLOCK=_BLOCK, ROWS=_ROWS, BLOCK_R=triton.next_power_of_2(total),
    )  # fmt: skip
    return a_out, diag


@cached_launch
@triton.jit
def _pack(
    a_out, diag, a0, a1, a2, b0, b1, b2, s0, s1, s2, r0, r1, r2, n0, n1, n2,
    width, total, a_programs,
    PARTS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Programs below ``a_programs`` copy ``BLOCK`` elements each of the joined A (the
    parts one after another, cast); the others write ``ROWS`` rows each of the block
    diagonal (row j of part i: ``s_i B_i[j]`` at columns ``r_0 + ... + r_{i-1}``, zeros
    elsewhere). (The branches share no names: a compiled kernel's branches must give
    a name one type.)"""
    pid = tl.program_id(0)
    if pid < a_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        end0 = r0 * width
        end1 = end0 + r1 * width
        end2 = end1 + r2 * width
        joined = tl.load(a0 + offs, mask=offs < end0, other=0.0).to(tl.float32)
        if PARTS > 1:
            take1 = (offs >= end0) & (offs < end1)
            joined += tl.load(a1 + (offs - end0), mask=take1, other=0.0).to(tl.float32)
        if PARTS > 2:
            take2 = (offs >= end1) & (offs < end2)
            joined += tl.load(a2 + (offs - end1), mask=take2, other=0.0).to(tl.float32)
        tl.store(
            a_out + offs,
            joined.to(a_out.dtype.element_ty, fp_downcast_rounding="rtne"),
            mask=offs < end2,
        )
    else:
        rows = (pid - a_programs) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_R)
        in0 = (rows < n0)[:, None] & (cols < r0)[None, :]
        v = tl.load(b0 + rows[:, None] * r0 + cols[None, :], mask=in0, other=0.0)
        v = v.to(tl.float32) * s0
        if PARTS > 1:
            rows1, cols1 = rows - n0, cols - r0
            in1 = ((rows1 >= 0) & (rows1 < n1))[:, None] & ((cols1 >= 0) & (cols1 < r1))[None, :]
            v1 = tl.load(b1 + rows1[:, None] * r1 + cols1[None, :], mask=in1, other=0.0)
            v += v1.to(tl.float32) * s1
        if PARTS > 2:
            rows2, cols2 = rows - n0 - n1, cols - r0 - r1
            in2 = ((rows2 >= 0) & (rows2 < n2))[:, None] & ((cols2 >= 0) & (cols2 < r2))[None, :]
            v2 = tl.load(b2 + rows2[:, None] * r2 + cols2[None, :], mask=in2, other=0.0)
            v += v2.to(tl.float32) * s2
        inside = (rows < n0 + n1 + n2)[:, None] & (cols < total)[None, :]
        rounded = v.to(diag.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(diag + rows[:, None] * total + cols[None, :], rounded, mask=inside)

r"""LoRA's dropout inside the adapters' GEMMs: the masks drawn in place from one seed,
kept as bits.

peft computes ``B(A(dropout(x)))`` for each adapter: a full-width dropped copy of ``x``
per adapter (q, k and v each draw their own), its mask kept for the backward, the
gradient of each copy sent back through its mask and summed into ``x``'s. Here the
adapters read ``x`` itself and the mask is applied where ``x`` is read:

- forward: :math:`t_i = (x \odot m_i) A_i^\top / (1 - p)` by one kernel per group, which
  draws the masks and writes them as bits (one bit per element, an eighth of a
  ``bool`` mask);
- backward: :math:`\partial A_i = (\partial s_i^\top (x \odot m_i)) / (1 - p)` (partial
  sums over row blocks, added in a fixed order: the result does not depend on
  scheduling), and :math:`\partial x \mathrel{+}= \sum_i ((\partial s_i A_i) \odot m_i)
  / (1 - p)` accumulated into the base GEMM's :math:`\partial x` in place.

The draw: one seed per call from the device's default generator (so a seeded run, a CUDA
graph's replays and a checkpointed segment's recompute draw as the first forward did);
adapter :math:`i` keeps element :math:`(r, c)` of the ``(rows, width)`` input where
uniform :math:`c \bmod 4` of Philox's four for ``(seed + i, r * ceil(width / 4) + c // 4)``
(Triton's ``rand4x``) is at least :math:`p`. Each element is
kept with probability :math:`1 - p`, independently across elements and adapters, as
peft's ``nn.Dropout`` draws; the masks are not PyTorch's (the policy's ``torch`` kernel
draws those).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._cached_launch import cached_launch
from ._launch import cdiv, through_registered_op

__all__ = ["draw_seed", "dropped_down", "dropped_grads", "fits", "keep_masks"]

_BLOCK_M = 64
_DOWN_BLOCK_M = 32  # the forward's rows per program: two programs per SM at 8k tokens
_BLOCK_K = 64
_SPLIT_ROWS = 1024  # rows per partial sum of dA
_EXACT = (torch.float32, torch.float64)  # dots in IEEE arithmetic, as PyTorch's GEMMs


def fits(rows: int, width: int, ranks: tuple[int, ...], ps: tuple[float, ...]) -> str | None:
    """Why the kernels cannot run these adapters' dropout (None: they can)."""
    if len(set(ranks)) != 1:
        return f"adapters of one input with different ranks ({ranks})"
    if len(set(ps)) != 1:
        return f"adapters of one input with different dropout probabilities ({ps})"
    if not 0.0 < ps[0] < 1.0:
        return f"dropout probability {ps[0]} outside (0, 1)"
    if rows * cdiv(width, 4) >= 2**31:
        return f"{rows} x {width} inputs number their draws past 2**31"
    return None


def draw_seed(device: torch.device) -> Tensor:
    """The call's seed: one draw of the device's default generator (a 1-element tensor,
    so that a CUDA graph replays a fresh draw)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


@triton.jit
def _kept(seed, i, offs_m, offs_k, width, p):
    """Whether adapter ``i`` keeps elements ``(offs_m, offs_k)`` (any columns)."""
    quads = offs_m[:, None] * ((width + 3) // 4) + (offs_k // 4)[None, :]
    u0, u1, u2, u3 = tl.rand4x(seed + i, quads)
    lane = (offs_k % 4)[None, :]
    u = tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))
    return u >= p


@triton.jit
def _packed_keep(seed, i, offs_m, k0, width, p, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Adapter ``i``'s mask of columns ``k0 .. k0 + BLOCK_K`` (``k0`` a multiple of 8)
    as (BLOCK_M, BLOCK_K // 8) int32 bytes, bit j of byte b the element ``k0 + 8 b + j``:
    two Philox draws of four uniforms per byte, no register reshape (Triton 3.6 cannot
    lower one into a store)."""
    packed = tl.zeros((BLOCK_M, BLOCK_K // 8), dtype=tl.int32)
    for h in tl.static_range(2):
        quads = k0 // 4 + tl.arange(0, BLOCK_K // 8) * 2 + h
        u0, u1, u2, u3 = tl.rand4x(seed + i, offs_m[:, None] * ((width + 3) // 4) + quads[None, :])
        packed |= (u0 >= p).to(tl.int32) << (4 * h)
        packed |= (u1 >= p).to(tl.int32) << (4 * h + 1)
        packed |= (u2 >= p).to(tl.int32) << (4 * h + 2)
        packed |= (u3 >= p).to(tl.int32) << (4 * h + 3)
    return packed


@triton.jit
def _unpack(bytes_, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    bits = (bytes_.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
    return tl.reshape(bits, (BLOCK_M, BLOCK_K)) != 0


@cached_launch
@triton.jit
def _dropped_down_kernel(
    x_ptr, a_ptr, t_ptr, bits_ptr, seed_ptr, p, scale, rows, width,
    stride_x, stride_a, stride_t, bytes_per_row,
    RANK: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_m, i = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    in_m = offs_m < rows
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for k0 in range(0, width, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < width
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)  # fmt: skip
        packed = _packed_keep(seed, i, offs_m, k0, width, p, BLOCK_M, BLOCK_K)
        offs_b = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        tl.store(bits_ptr + (i * rows + offs_m[:, None]) * bytes_per_row + offs_b[None, :],
                 packed.to(tl.uint8), mask=in_m[:, None] & (offs_b[None, :] < bytes_per_row))  # fmt: skip
        keep = _unpack(packed, BLOCK_M, BLOCK_K)
        a = tl.load(a_ptr + (i * RANK + offs_r[None, :]) * stride_a + offs_k[:, None],
                    mask=(offs_r[None, :] < RANK) & in_k[:, None], other=0.0)  # fmt: skip
        x = tl.where(keep, x, 0.0).to(a.dtype)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    out = (acc * scale).to(t_ptr.dtype.element_ty)
    tl.store(t_ptr + offs_m[:, None] * stride_t + (i * RANK + offs_r[None, :]), out,
             mask=in_m[:, None] & (offs_r[None, :] < RANK))  # fmt: skip


@cached_launch
@triton.jit
def _dropped_dx_kernel(
    dx_ptr, ds_ptr, a_ptr, bits_ptr, scale, rows, width,
    stride_dx, stride_ds, stride_a, bytes_per_row,
    ADAPTERS: tl.constexpr, RANK: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_b = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    in_m, in_k, in_r = offs_m < rows, offs_k < width, offs_r < RANK
    tile = in_m[:, None] & in_k[None, :]
    dx = tl.load(dx_ptr + offs_m[:, None] * stride_dx + offs_k[None, :], mask=tile, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC)
    for i in tl.static_range(ADAPTERS):
        ds = tl.load(ds_ptr + offs_m[:, None] * stride_ds + (i * RANK + offs_r[None, :]),
                     mask=in_m[:, None] & in_r[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_ptr + (i * RANK + offs_r[:, None]) * stride_a + offs_k[None, :],
                    mask=in_r[:, None] & in_k[None, :], other=0.0)  # fmt: skip
        if IEEE:
            g = tl.dot(ds, a, input_precision="ieee")
        else:
            g = tl.dot(ds, a)
        packed = tl.load(bits_ptr + (i * rows + offs_m[:, None]) * bytes_per_row + offs_b[None, :],
                         mask=in_m[:, None] & (offs_b[None, :] < bytes_per_row), other=0)  # fmt: skip
        acc += tl.where(_unpack(packed, BLOCK_M, BLOCK_K), g, 0.0)
    out = dx.to(ACC) + acc * scale
    tl.store(dx_ptr + offs_m[:, None] * stride_dx + offs_k[None, :],
             out.to(dx_ptr.dtype.element_ty), mask=tile)  # fmt: skip


@cached_launch
@triton.jit
def _dropped_da_kernel(
    x_ptr, ds_ptr, part_ptr, bits_ptr, scale, rows, width, split_rows,
    stride_x, stride_ds, bytes_per_row, total_rank,
    RANK: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_k, i, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_b = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    in_k, in_r = offs_k < width, offs_r < RANK
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC)
    start = split * split_rows
    for m0 in range(start, start + split_rows, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < rows
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)  # fmt: skip
        packed = tl.load(bits_ptr + (i * rows + offs_m[:, None]) * bytes_per_row + offs_b[None, :],
                         mask=in_m[:, None] & (offs_b[None, :] < bytes_per_row), other=0)  # fmt: skip
        x = tl.where(_unpack(packed, BLOCK_M, BLOCK_K), x, 0.0).to(x_ptr.dtype.element_ty)
        ds = tl.load(ds_ptr + offs_m[:, None] * stride_ds + (i * RANK + offs_r[None, :]),
                     mask=in_m[:, None] & in_r[None, :], other=0.0)  # fmt: skip
        if ACC == tl.float64:  # Triton 3.6 cannot lower an fp64 dot of a transposed tile
            acc += tl.sum(ds[:, :, None] * x[:, None, :], axis=0)
        elif IEEE:
            acc += tl.dot(tl.trans(ds), x, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(ds), x)
    tl.store(part_ptr + (split * total_rank + i * RANK + offs_r[:, None]) * width + offs_k[None, :],
             acc * scale, mask=in_r[:, None] & in_k[None, :])  # fmt: skip


def _acc(dtype: torch.dtype):
    """What the kernels accumulate in: fp64 for fp64 inputs, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def dropped_down(
    rows: Tensor, a: Tensor, adapters: int, p: float, seed: Tensor
) -> tuple[Tensor, Tensor]:
    if through_registered_op():  # torch.compile traces the op, not the kernel
        return torch.ops.xpuruntime.lora_dropped_down(rows, a, adapters, p, seed)
    return _dropped_down(rows, a, adapters, p, seed)


def _dropped_down(
    rows: Tensor, a: Tensor, adapters: int, p: float, seed: Tensor
) -> tuple[Tensor, Tensor]:
    """``t = [(x ⊙ m_i) A_i^T / (1 - p)]_i`` for ``rows`` (tokens, width) and the joined
    ``a`` (adapters * rank, width), both in the compute dtype; returns ``t`` (tokens,
    adapters * rank) and the masks as bits (adapters, tokens, ceil(width / 8))."""
    tokens, width = rows.shape
    rank = a.shape[0] // adapters
    t = rows.new_empty((tokens, a.shape[0]))
    bytes_per_row = cdiv(width, 8)
    bits = torch.empty((adapters, tokens, bytes_per_row), dtype=torch.uint8, device=rows.device)
    grid = (cdiv(tokens, _DOWN_BLOCK_M), adapters)
    _dropped_down_kernel[grid](
        rows, a, t, bits, seed, p, 1.0 / (1.0 - p), tokens, width,
        rows.stride(0), a.stride(0), t.stride(0), bytes_per_row,
        RANK=rank, IEEE=rows.dtype in _EXACT, ACC=_acc(rows.dtype),
        BLOCK_M=_DOWN_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=_block_r(rank),
    )  # fmt: skip
    return t, bits


def dropped_grads(
    dx: Tensor | None, ds: Tensor, rows: Tensor, a: Tensor, bits: Tensor, p: float,
    need_a: bool,
) -> Tensor | None:  # fmt: skip
    """Adds ``sum_i ((ds_i A_i) ⊙ m_i) / (1 - p)`` into ``dx`` (tokens, width) in place
    (where given) and returns ``dA`` (adapters * rank, width) in fp32 (fp64 for fp64
    inputs; where ``need_a``)."""
    traced = through_registered_op()  # torch.compile traces the ops, not the kernels
    if dx is not None:
        (torch.ops.xpuruntime.lora_dropped_dx_ if traced else _dropped_dx)(dx, ds, a, bits, p)
    if not need_a:
        return None
    return (torch.ops.xpuruntime.lora_dropped_da if traced else _dropped_da)(ds, rows, bits, p)


def _dropped_dx(dx: Tensor, ds: Tensor, a: Tensor, bits: Tensor, p: float) -> None:
    adapters, tokens, bytes_per_row = bits.shape
    width, rank = dx.shape[1], a.shape[0] // adapters
    grid = (cdiv(tokens, _BLOCK_M), cdiv(width, _BLOCK_K))
    _dropped_dx_kernel[grid](
        dx, ds, a, bits, 1.0 / (1.0 - p), tokens, width,
        dx.stride(0), ds.stride(0), a.stride(0), bytes_per_row,
        ADAPTERS=adapters, RANK=rank, IEEE=dx.dtype in _EXACT, ACC=_acc(dx.dtype),
        BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=_block_r(rank),
    )  # fmt: skip


def _dropped_da(ds: Tensor, rows: Tensor, bits: Tensor, p: float) -> Tensor:
    adapters, tokens, bytes_per_row = bits.shape
    width, total_rank = rows.shape[1], ds.shape[1]
    rank = total_rank // adapters
    splits = cdiv(tokens, _SPLIT_ROWS)
    parts = torch.empty((splits, total_rank, width), dtype=_wide(rows.dtype), device=rows.device)
    grid = (cdiv(width, _BLOCK_K), adapters, splits)
    _dropped_da_kernel[grid](
        rows, ds, parts, bits, 1.0 / (1.0 - p), tokens, width, _SPLIT_ROWS,
        rows.stride(0), ds.stride(0), bytes_per_row, total_rank,
        RANK=rank, IEEE=rows.dtype in _EXACT, ACC=_acc(rows.dtype),
        BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=_block_r(rank),
    )  # fmt: skip
    return parts[0] if splits == 1 else parts.sum(0)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# The kernels as torch ops, for torch.compile (which cannot trace into Triton's
# interpreter, and needs the outputs' shapes without running them).
@torch.library.custom_op("xpuruntime::lora_dropped_down", mutates_args=())
def _dropped_down_op(
    rows: Tensor, a: Tensor, adapters: int, p: float, seed: Tensor
) -> tuple[Tensor, Tensor]:
    return _dropped_down(rows, a, adapters, p, seed)


@_dropped_down_op.register_fake
def _(rows, a, adapters, p, seed):
    bits = rows.new_empty((adapters, rows.shape[0], cdiv(rows.shape[1], 8)), dtype=torch.uint8)
    return rows.new_empty((rows.shape[0], a.shape[0])), bits


@torch.library.custom_op("xpuruntime::lora_dropped_dx_", mutates_args=("dx",))
def _dropped_dx_op(dx: Tensor, ds: Tensor, a: Tensor, bits: Tensor, p: float) -> None:
    _dropped_dx(dx, ds, a, bits, p)


@_dropped_dx_op.register_fake
def _(dx, ds, a, bits, p):
    return None


@torch.library.custom_op("xpuruntime::lora_dropped_da", mutates_args=())
def _dropped_da_op(ds: Tensor, rows: Tensor, bits: Tensor, p: float) -> Tensor:
    return _dropped_da(ds, rows, bits, p)


@_dropped_da_op.register_fake
def _(ds, rows, bits, p):
    return rows.new_empty((ds.shape[1], rows.shape[1]), dtype=_wide(rows.dtype))


@cached_launch
@triton.jit
def _keep_kernel(out_ptr, seed_ptr, p, rows, width, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_k, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    keep = _kept(tl.load(seed_ptr), i, offs_m, offs_k, width, p)
    tl.store(out_ptr + (i * rows + offs_m[:, None]) * width + offs_k[None, :], keep.to(tl.int8),
             mask=(offs_m[:, None] < rows) & (offs_k[None, :] < width))  # fmt: skip


def keep_masks(seed: Tensor, adapters: int, rows: int, width: int, p: float) -> Tensor:
    """The masks a call with ``seed`` draws, as booleans (adapters, rows, width): what a
    reference computation needs to repeat the fused op's dropout."""
    out = torch.empty((adapters, rows, width), dtype=torch.int8, device=seed.device)
    grid = (cdiv(rows, _BLOCK_M), cdiv(width, _BLOCK_K), adapters)
    _keep_kernel[grid](out, seed, p, rows, width, BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_K)
    return out.bool()

"""The second stage of our persistent reductions: the per-program partial rows, summed.

The backward kernels of the norms and the column sums write one fp32 row of partial
sums per program (a few hundred rows); adding them up is a tiny reduction that
``Tensor.sum(0)`` runs in about 8 us on an H100, latency-bound. This kernel gives each
program a narrow strip of columns and walks the rows in tiles, in a fixed order (so
the result is deterministic), in one short launch. It runs where GPU time is what
counts: inside CUDA-graph capture, on the CPU under the interpreter, and in the launch
programs replayed from C++ (:mod:`._native`). Otherwise PyTorch's reduction (as
deterministic, fp32) runs instead: there the host's time per launch decides, and a launch
from C++ costs about a third of ours from Python (H200 host: 7 µs for a PyTorch
elementwise op, 21 µs for this kernel with its output buffer).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._cached_launch import cached_launch, planning
from ._capture_paths import capture_paths
from ._launch import cast, cdiv

__all__ = ["sum_rows"]

_BLOCK_ROWS = 64
_BLOCK_COLS = 32


@cached_launch
@triton.jit
def _sum_rows(
    p_ptr,  # (K, G, N) fp32 partial sums, dense
    out_ptr,  # (K, N), written in its own dtype
    G,
    N,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    k = tl.program_id(1).to(tl.int64)
    p_ptr += k * G * N
    out_ptr += k * N
    col_mask = cols < N
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, G, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < G)[:, None] & col_mask[None, :]
        acc += tl.load(p_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


def sum_rows(partial: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``partial.sum(-2)`` for a dense (G, N) or (K, G, N) fp32 tensor of partial sums,
    summed in fp32 and written in ``dtype`` (one launch for all K: a norm's weight and
    bias gradients, already in the parameters' dtype)."""
    g, n = partial.shape[-2:]
    planned = planning()  # a plan holds launches, not casts or sums
    if g == 1 and (not planned or dtype == partial.dtype):
        return cast(partial.select(-2, 0), dtype)
    if partial.is_cuda and not capture_paths(partial.device) and not planned:
        return cast(partial.sum(-2), dtype)
    out = torch.empty((*partial.shape[:-2], n), device=partial.device, dtype=dtype)
    k = partial.shape[0] if partial.dim() == 3 else 1
    _sum_rows[(cdiv(n, _BLOCK_COLS), k)](
        partial, out, g, n, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4
    )
    return out

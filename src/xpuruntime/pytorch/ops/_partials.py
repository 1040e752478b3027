"""The second stage of our persistent reductions: the per-program partial rows, summed.

The backward kernels of the norms and the column sums write one fp32 row of partial
sums per program (a few hundred rows); adding them up is a tiny reduction that
``Tensor.sum(0)`` runs in about 8 us on an H100, latency-bound. This kernel gives each
program a narrow strip of columns and walks the rows in tiles, in a fixed order (so
the result is deterministic), in one short launch.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["sum_rows"]

_BLOCK_ROWS = 64
_BLOCK_COLS = 32


@triton.jit
def _sum_rows(
    p_ptr,  # (G, N) fp32 partial sums, dense rows
    out_ptr,  # (N,) fp32
    G,
    N,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, G, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < G)[:, None] & col_mask[None, :]
        acc += tl.load(p_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


def sum_rows(partial: Tensor) -> Tensor:
    """``partial.sum(0)`` for a dense (G, N) fp32 tensor of partial sums, in fp32."""
    g, n = partial.shape
    if g == 1:
        return partial[0]
    out = torch.empty(n, device=partial.device, dtype=torch.float32)
    _sum_rows[(triton.cdiv(n, _BLOCK_COLS),)](
        partial, out, g, n, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4
    )
    return out

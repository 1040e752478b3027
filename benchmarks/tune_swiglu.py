"""Launch parameters for the LoRA MLP's adapter gradient after SwiGLU
(``ops.swiglu._swiglu_left_product``: ``m^T (silu(gate) * up)`` from gate and up packed in
one row, h never stored): rows and columns a program takes, warps, and programs per SM
(the rows' splits). Prints us and GB/s of gate and up read, at rank 16 over the LoRA rows'
shapes (8192 tokens; Qwen3-1.7B's 6144, Llama-1B's 8192 and Llama-8B's 14336 wide), best
first; the winners go into ops.swiglu by hand.

    python benchmarks/tune_swiglu.py
"""

import importlib
import itertools

import torch
import triton
from triton.testing import do_bench

from xpuruntime.pytorch._ops._infra._launch import _sm_count
from xpuruntime.pytorch._ops._infra._partials import sum_rows

swiglu = importlib.import_module("xpuruntime.pytorch._ops.swiglu")


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, rank 16")
    for cols in (6144, 8192, 14336):
        tune(8192, cols)


def tune(rows: int, cols: int, rank: int = 16) -> None:
    pair = torch.randn(rows, 2 * cols, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(rows, rank, device="cuda", dtype=torch.bfloat16)
    shipped = do_bench(lambda: swiglu._left_product(False, m, pair), return_mode="median")
    results = []
    configs = itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 4, 8))
    for block_m, block_n, warps, per_sm in configs:
        column_blocks = triton.cdiv(cols, block_n)
        splits, per_split = swiglu.product_splits(
            rows, column_blocks, block_m, per_sm * _sm_count(0)
        )
        partial = torch.empty((splits, rank, cols), device="cuda", dtype=torch.float32)

        def run(block_m=block_m, block_n=block_n, warps=warps, splits=splits,
                per_split=per_split, partial=partial, column_blocks=column_blocks):  # fmt: skip
            swiglu._swiglu_left_product[(column_blocks, splits)](
                m, pair, pair, partial, pair, pair, rows, cols, rank, per_split, m.stride(0),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=rank, GELU=False, PACKED=True,
                SCALED=False, FP32_DOT=False, num_warps=warps,
            )  # fmt: skip
            if splits > 1:
                sum_rows(partial.view(splits, rank * cols))

        try:
            results.append((do_bench(run, return_mode="median"), block_m, block_n, warps, per_sm))
        except Exception as e:  # out of registers or shared memory
            print(f"  {block_m}x{block_n} {warps}w {per_sm}/SM: {type(e).__name__}")
    results.sort()
    read = 2 * rows * cols * 2
    cells = [f"{bm}x{bn} {w}w {s}/SM {ms * 1e3:.0f} us ({read / ms / 1e6:.0f})"
             for ms, bm, bn, w, s in results[:6]]  # fmt: skip
    print(f"{rows}x{cols}: shipped {shipped * 1e3:.0f} us ({read / shipped / 1e6:.0f} GB/s); "
          "best " + ", ".join(cells), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

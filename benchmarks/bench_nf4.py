"""QLoRA's 4-bit base made dense on the GPU: our Triton pass to bf16 (what every QLoRA
step runs twice per layer), and to e4m3 by rows under ``precision="fp8"`` in the rows
layout (the forward GEMM's) and the columns layout (the input gradient's), for each tile
shape of the FP8 pass tried, and its flat blocks (``None``: the columns as the rows
transposed after); bitsandbytes' own ``dequantize_4bit`` beside them. Weights
of Llama-3.2-3B's and Llama-3.1-8B's layer groups, nf4, double-quantized (QLoRA's
``bnb_4bit_use_double_quant``). Microseconds per group, and GB/s of bytes read and
written.

Usage: python benchmarks/bench_nf4.py [--iters 50]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {  # group -> each weight's (out, in)
    "3B q/k/v": ((3072, 3072), (1024, 3072), (1024, 3072)),
    "3B gate/up": ((8192, 3072), (8192, 3072)),
    "3B down": ((3072, 8192),),
    "8B q/k/v": ((4096, 4096), (1024, 4096), (1024, 4096)),
    "8B gate/up": ((14336, 4096), (14336, 4096)),
    "8B down": ((4096, 14336),),
}
TILES = ((64, 64, 4), (64, 64, 8), (32, 128, 4), (16, 256, 4), (8, 512, 4), (128, 64, 8),
         (64, 128, 8), (128, 128, 8), (32, 32, 4))  # fmt: skip


def weights_of(shapes) -> tuple:
    import bitsandbytes as bnb

    out = []
    for rows, cols in shapes:
        w = torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02
        p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True)
        out.append(p.cuda())
    return tuple(out)


def timed_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def rate(us: float, elements: int, per_element: float) -> str:
    """Microseconds, and GB/s of ``per_element`` bytes read and written per element."""
    return f"{us:.0f} ({elements * per_element / us / 1e3:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    from bitsandbytes import functional as bnb_functional

    from xpuruntime.pytorch._ops import nf4

    print(f"# {torch.cuda.get_device_name()}, nf4 double-quantized, us per group (GB/s)")
    best: dict[bool, dict] = {False: {}, True: {}}
    rows_out = []
    for name, shapes in SHAPES.items():
        weights = weights_of(shapes)
        elements = sum(r * c for r, c in shapes)
        bf16 = timed_us(lambda w=weights: nf4.joined_4bit(w, torch.bfloat16), args.iters)
        theirs = timed_us(
            lambda w=weights: [bnb_functional.dequantize_4bit(p.data, p.quant_state) for p in w],
            args.iters,
        )
        found = {}
        for columns in (False, True):
            for tile in (None, *TILES):
                nf4.FP8_TILES[columns] = tile
                found[columns, tile] = timed_us(
                    lambda w=weights, c=columns: nf4.fp8_4bit(w, columns=c), args.iters
                )
                best[columns].setdefault(tile, []).append(found[columns, tile])
        rows_out.append((name, elements, theirs, bf16, found))
    print("| group | bitsandbytes | ours bf16 | fp8 rows, best tile | fp8 columns, best tile |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, elements, theirs, bf16, found in rows_out:
        cells = []
        for columns in (False, True):
            tile = min((t for c, t in found if c == columns), key=lambda t: found[columns, t])
            cells.append(f"{rate(found[columns, tile], elements, 1.5)} {tile}")
        bnb_cell, ours = rate(theirs, elements, 2.5), rate(bf16, elements, 2.5)
        print(f"| {name} | {bnb_cell} | {ours} | {cells[0]} | {cells[1]} |")
    print("\n| tile (rows, columns, warps) | rows layout, us summed | columns layout, us summed |")
    print("| --- | ---: | ---: |")
    for tile in (None, *TILES):
        name = tile or "flat blocks (columns: transposed after)"
        print(f"| {name} | {sum(best[False][tile]):.0f} | {sum(best[True][tile]):.0f} |")


if __name__ == "__main__":
    main()

"""QLoRA's 4-bit base made dense on the GPU: our Triton pass to bf16 (what every QLoRA
step runs twice per layer), and to e4m3 by rows under ``precision="fp8"`` in the rows
layout (the forward GEMM's) and the columns layout (the input gradient's: the rows
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
    print("| group | bitsandbytes | ours bf16 | fp8 rows | fp8 columns |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, shapes in SHAPES.items():
        weights = weights_of(shapes)
        elements = sum(r * c for r, c in shapes)
        bf16 = timed_us(lambda w=weights: nf4.joined_4bit(w, torch.bfloat16), args.iters)
        theirs = timed_us(
            lambda w=weights: [bnb_functional.dequantize_4bit(p.data, p.quant_state) for p in w],
            args.iters,
        )
        # (the columns: the rows' pass, then a read and a write of each e4m3 byte)
        fp8 = [
            rate(timed_us(lambda w=weights, c=c: nf4.fp8_4bit(w, columns=c), args.iters),
                 elements, per_element)
            for c, per_element in ((False, 1.5), (True, 3.5))
        ]  # fmt: skip
        bnb_cell, ours = rate(theirs, elements, 2.5), rate(bf16, elements, 2.5)
        print(f"| {name} | {bnb_cell} | {ours} | {fp8[0]} | {fp8[1]} |")


if __name__ == "__main__":
    main()

"""The fused LM-head loss by rows per chunk, on the heads of the models we train.

For each head shape (vocabulary x hidden), N rows of bf16-autocast hidden states: the
forward and backward of ``fused_linear_cross_entropy`` with the chunk rows the op chooses
and with fixed ones (every row count the choice could make), against PyTorch's
``F.linear`` + ``F.cross_entropy``; ms per call and the memory the call adds at its peak.
A trained head (fp32 weight, its gradient accumulated over the chunks) and a frozen one
(LoRA: the input's gradient only).

Usage: python benchmarks/bench_head.py [--rows 8192] [--reps 10]
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial

import torch
import torch.nn.functional as F

flce = importlib.import_module("xpuruntime.pytorch._ops.fused_linear_cross_entropy")

HEADS = {  # name: (vocabulary, hidden)
    "llama-1b": (128256, 2048),
    "llama-8b": (128256, 4096),
    "qwen3-1.7b": (151936, 2048),
    "gemma3-1b": (262144, 1152),
}


def _timed(run, reps: int) -> tuple[float, float]:
    """ms per call of ``run`` and the GiB it adds at its peak."""
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps, peak


def _step(x, weight, target, chunk) -> None:
    """One forward and backward: PyTorch's (``chunk="torch"``), the op's own choice of
    chunk rows (None), or the op's autograd Function on ``chunk`` rows."""
    x.grad = weight.grad = None
    with torch.autocast("cuda", torch.bfloat16):
        if chunk == "torch":
            loss = F.cross_entropy(F.linear(x, weight).float(), target)
        elif chunk is None:
            loss = flce.fused_linear_cross_entropy(x, weight, target)
        else:
            xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
            with torch.autocast("cuda", enabled=False):
                loss = flce._LinearCrossEntropy.apply(
                    xb, wb, None, target, -100, "mean", chunk, 1.0, None
                )
    loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rows} rows, bf16")
    print("| head | weight | chunk rows | ms | vs PyTorch | peak GiB added |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (vocab, hidden) in HEADS.items():
        torch.manual_seed(0)
        x = torch.randn(args.rows, hidden, device=device, requires_grad=True)
        target = torch.randint(0, vocab, (args.rows,), device=device)
        for trained in (True, False):
            weight = torch.randn(vocab, hidden, device=device) * hidden**-0.5
            weight.requires_grad_(trained)
            kind = "trained" if trained else "frozen"
            anchor, peak = _timed(partial(_step, x, weight, target, "torch"), args.reps)
            print(f"| {name} | {kind} | PyTorch | {anchor:.2f} | 1.00x | {peak:.2f} |")
            chosen = flce.chunk_rows(args.rows, vocab, hidden, 2, trained)
            for chunk in sorted({256, 512, 1024, 2048, 4096, args.rows, chosen}):
                ms, peak = _timed(partial(_step, x, weight, target, chunk), args.reps)
                mark = " (chosen)" if chunk == chosen else ""
                print(
                    f"| {name} | {kind} | {chunk}{mark} | {ms:.2f} | {anchor / ms:.2f}x | {peak:.2f} |"
                )
            weight = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

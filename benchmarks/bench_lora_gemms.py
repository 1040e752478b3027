"""Every GEMM of a LoRA step's linear layers, as the ``lora_linear`` op calls them, under
cuBLAS's own choice of algorithm and under PyTorch's TunableOp (which times the
libraries' candidates per shape and keeps the fastest): how much a tuned choice would
take off a GEMM-bound step.

Shapes: Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B's projections at 8192 tokens
(B4 x T2048, or B2 x T4096), bf16, LoRA rank 16 on all seven layers (q/k/v and gate/up
joined, as the op runs them). Per layer group: the base's forward GEMM, its input
gradient, and the adapters' four small GEMMs (``t = x A^T``, ``ds = dY diag(B)``,
``dA = ds^T x``, ``dB = dY^T t``). Times are CUDA-event medians (``do_bench``), the
default before and after the tuned run, in one process.

Usage: python benchmarks/bench_lora_gemms.py [--models 1b,3b,8b] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from triton.testing import do_bench

MODELS = {  # hidden, intermediate, heads x head_dim of q, of k and v
    "1b": (2048, 8192, 2048, 512),
    "3b": (3072, 8192, 3072, 1024),
    "8b": (4096, 14336, 4096, 1024),
}


def gemms(hidden: int, inter: int, q: int, kv: int, tokens: int, rank: int):
    """(name, flops, fn) for each GEMM of one layer's four groups, as the op calls them."""
    dev, bf = "cuda", torch.bfloat16
    groups = {
        "qkv": (hidden, (q, kv, kv)),
        "o": (q, (hidden,)),
        "gate/up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }
    out = []
    for name, (k, outs) in groups.items():
        n, r = sum(outs), rank * len(outs)
        x = torch.randn(tokens, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) * k**-0.5
        a = torch.randn(r, k, device=dev, dtype=bf) * k**-0.5
        diag = torch.randn(n, r, device=dev, dtype=bf)
        dy = torch.randn(tokens, n, device=dev, dtype=bf)
        t = torch.randn(tokens, r, device=dev, dtype=bf)
        ds = torch.randn(tokens, r, device=dev, dtype=bf)
        unread = x.new_empty(())
        dyt = dy.t().split(list(outs))
        ts = t.split([rank] * len(outs), 1)
        out += [
            (f"{name} y = x W^T", 2 * tokens * n * k, lambda x=x, w=w: torch.nn.functional.linear(x, w)),
            (f"{name} dx = dY W", 2 * tokens * n * k, lambda dy=dy, w=w: dy @ w),
            (f"{name} t = s x A^T", 2 * tokens * r * k,
             lambda x=x, a=a, u=unread: torch.addmm(u, x, a.t(), beta=0, alpha=2.0)),
            (f"{name} ds = s dY B", 2 * tokens * n * r,
             lambda dy=dy, d=diag, u=unread: torch.addmm(u, dy, d, beta=0, alpha=2.0)),
            (f"{name} dA = ds^T x", 2 * tokens * r * k, lambda ds=ds, x=x: ds.t() @ x),
            (f"{name} dB = dY^T t", 2 * tokens * n * rank,
             lambda dyt=dyt, ts=ts: [d @ t_ for d, t_ in zip(dyt, ts)]),
        ]  # fmt: skip
    return out


def timed(cases: list) -> list[float]:
    return [do_bench(fn, warmup=10, rep=60, return_mode="median") for _, _, fn in cases]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="1b,3b,8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"{args.tokens} tokens, rank {args.rank}; ms, TFLOP/s")  # fmt: skip
    tunable = torch.cuda.tunable
    for model in args.models.split(","):
        cases = gemms(*MODELS[model], args.tokens, args.rank)
        before = timed(cases)
        tunable.set_filename(os.path.join(tempfile.mkdtemp(), f"tunable_{model}.csv"))
        tunable.enable(True)
        tunable.tuning_enable(True)
        tunable.set_max_tuning_iterations(30)
        for _, _, fn in cases:  # tuned on the first calls of each shape
            fn()
        torch.cuda.synchronize()
        tunable.tuning_enable(False)
        tuned = timed(cases)
        tunable.enable(False)
        after = timed(cases)
        print(f"\n## {model}\n| GEMM | default | tuned | default again | tuned / best default |")
        print("| --- | ---: | ---: | ---: | ---: |")
        sums = [0.0, 0.0, 0.0]
        for (name, flops, _), b, t, a in zip(cases, before, tuned, after):
            best = min(b, a)
            sums = [sums[0] + best, sums[1] + t, sums[2] + a]
            cells = " | ".join(f"{ms:.3f} ({flops / ms / 1e9:.0f})" for ms in (b, t, a))
            print(f"| {name} | {cells} | {best / t:.2f}x |")
        print(f"| all, one layer | {sums[0]:.3f} | {sums[1]:.3f} | {sums[2]:.3f} | "
              f"{sums[0] / sums[1]:.3f}x |")  # fmt: skip
        results = list(tunable.get_results())
        print(f"({len(results)} tuned entries; e.g. {results[:3]})")


if __name__ == "__main__":
    main()

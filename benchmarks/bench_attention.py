"""Every attention kernel choice at several shapes, with auto's pick, in one run (GPU).

bf16, forward + backward, (batch, heads, seq, head_dim) with batch x seq = 16384 tokens
and heads x head_dim = 2048. TFLOP/s counts 4·B·H·S²·D forward and 2.5x that backward
(halved when causal). "auto" is ops.fused_attention under auto_strategy=
"best_performance": its pick is measured once per shape class (and cached), then timed
like the others, in the same interleaved rounds. Goal: auto within 3% of the fastest
choice at every shape.

    python benchmarks/bench_attention.py [--seqs 512,1024,2048,4096,8192]
"""

import argparse
import os
import tempfile

import torch

from xpuruntime import pytorch as xpt
from xpuruntime.kernels import registry
from xpuruntime.pytorch._kernels import register_kernels
from xpuruntime.pytorch._selection._routed import ROUTED_OPS
from xpuruntime.pytorch._selection._timing import compare_calls, time_call

register_kernels()
# flash_v4 where FlashAttention-4 is installed and runs on this GPU.
KERNELS = [
    k
    for k in ["flash_v2", "flash_v4", "cudnn", "efficient", "triton", "math"]
    if k != "flash_v4" or registry.get("attention", k).unavailable(torch.device("cuda")) is None
]
ROUNDS = 9


def fwd_bwd(kernel: str, q, k, v, grad, causal: bool) -> None:
    """One forward and backward by one kernel choice (the kernel runs itself)."""
    registry.get("attention", kernel).run(q, k, v, None, 0.0, causal, None).backward(grad)


def measure(b: int, h: int, seq: int, d: int, causal: bool) -> tuple[dict, float, str]:
    """Median TFLOP/s of each kernel and of auto, auto's speed relative to the fastest
    choice (median of the per-round ratios), and auto's pick, at one shape."""
    device = torch.device("cuda")
    q, k, v = (
        torch.randn(b, h, seq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    flops = 4 * b * h * seq * seq * d * 3.5 * (0.5 if causal else 1.0)

    xpt.set_kernel_policy(auto_strategy="best_performance")
    try:

        def auto():
            xpt.ops.fused_attention(q, k, v, is_causal=causal).backward(grad)

        auto()  # resolves (measures the candidates) once for this shape class
        pick = next(iter(ROUTED_OPS["attention"].decisions.values())).chosen
        runs = {
            kernel: (lambda kernel=kernel: fwd_bwd(kernel, q, k, v, grad, causal))
            for kernel in KERNELS
        }
        # math (S² scores in memory, 10-40x slower) is timed on its own, not in the
        # rotation, where its long low-power runs would change the clock the others see.
        math = runs.pop("math")
        runs["auto"] = auto
        # Interleaved rounds; auto is compared with the fastest choice round by round, so
        # that a GPU clocking down over the run does not decide the ratio.
        timed = compare_calls(runs, q.device, rounds=ROUNDS)
        tflops = {
            name: None if s is None else flops / s / 1e12 for name, s in timed.medians.items()
        }
        tflops["math"] = flops / time_call(math, q.device) / 1e12 if seq <= 4096 else None
        fastest = timed.fastest(among=[k for k in runs if k != "auto"])
        return tflops, timed.speed_ratio("auto", fastest), pick
    finally:
        xpt.clear_kernel_policy()


def peak_memory(b: int, h: int, seq: int, d: int, causal: bool) -> None:
    """Peak memory above the inputs of one fwd+bwd per kernel."""
    q, k, v = (
        torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    cells = []
    for kernel in KERNELS[:-1]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(kernel, q, k, v, grad, causal)
        torch.cuda.synchronize()
        cells.append(f"{kernel} {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}")
        for t in (q, k, v):
            t.grad = None
    print(f"peak MB above inputs, B{b} H{h} S{seq} D{d} causal={causal}: " + ", ".join(cells))


def row(b: int, h: int, seq: int, d: int, causal: bool) -> float:
    """Print one table row; return auto's speed relative to the fastest choice."""
    tflops, ratio, pick = measure(b, h, seq, d, causal)
    cells = " | ".join("-" if tflops.get(k) is None else f"{tflops[k]:.0f}" for k in KERNELS)
    print(
        f"| {b} {h} {seq} {d} | {causal} | {cells} | {tflops['auto']:.0f} ({pick}) | {ratio:.3f} |",
        flush=True,
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="512,1024,2048,4096,8192")
    parser.add_argument("--headline", action="store_true", help="only B4 H16 S4096 D128")
    args = parser.parse_args()
    os.environ["XPURUNTIME_CACHE_DIR"] = tempfile.mkdtemp()  # measure afresh
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"cuDNN {torch.backends.cudnn.version()}, bf16 fwd+bwd, median TFLOP/s over "
        f"{ROUNDS} interleaved rounds; auto / fastest = median of the per-round ratios"
    )
    print("| B H S D | causal | " + " | ".join(KERNELS) + " | auto (pick) | auto / fastest |")
    print("| --- | --- | " + " | ".join("---" for _ in KERNELS) + " | --- | --- |")
    if args.headline:
        for causal in (False, True):
            row(4, 16, 4096, 128, causal)
            peak_memory(4, 16, 4096, 128, causal)
        return
    ratios = [
        row(max(1, 16384 // seq), 2048 // d, seq, d, causal)
        for d in (64, 128)
        for seq in (int(s) for s in args.seqs.split(","))
        for causal in (False, True)
    ]
    print(f"\nworst shortfall of auto vs the fastest choice: {(1 - min(ratios)) * 100:.1f}%")


if __name__ == "__main__":
    main()

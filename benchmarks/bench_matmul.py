"""matmul kernel choices (cuBLAS vs cuBLASLt through PyTorch's preference) at several
shapes, with auto's pick, in one run (GPU).

The matmul choice is process-wide (PyTorch's preferred_blas_library), so auto with
best_performance picks one library for the process from representative GEMMs; this
table shows how far that single pick is from the per-shape best.

    python benchmarks/bench_matmul.py
"""

import os
import tempfile

import torch

from xpuruntime import pytorch as xpt
from xpuruntime.pytorch._selection._timing import Comparison, time_call

SHAPES = [  # (M, K, N): square, GPT-2 124M projections at 16k tokens, LM head
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 768, 2304),
    (16384, 768, 3072),
    (16384, 3072, 768),
    (16384, 768, 50304),
    (1024, 1024, 1024),
]
ROUNDS = 9


def main() -> None:
    device = torch.device("cuda")
    os.environ["XPURUNTIME_CACHE_DIR"] = tempfile.mkdtemp()
    xpt.set_kernel_policy(auto_strategy="best_performance")
    pick = _pick()
    xpt.clear_kernel_policy()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; auto picks {pick}")
    for dtype in (torch.bfloat16, torch.float32):
        print(
            f"\n{dtype}: median TFLOP/s over {ROUNDS} interleaved rounds"
            + (" (TF32 off)" if dtype == torch.float32 else "")
        )
        print("| M K N | cublas | cublasLt | auto | auto / fastest |")
        print("| --- | --- | --- | --- | --- |")
        worst = 1.0
        for m, k, n in SHAPES:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds: dict[str, list[float | None]] = {"cublas": [], "cublasLt": []}
            # Interleaved rounds in alternating order; auto's pick is compared with the
            # fastest library round by round (median of the ratios), so that a GPU
            # clocking down over the run does not decide the comparison.
            for round_ in range(ROUNDS):
                for kernel in sorted(seconds, reverse=bool(round_ % 2)):
                    with xpt.kernel_policy(matmul=kernel, tf32=False, strict=True):
                        seconds[kernel].append(time_call(lambda: a @ b, device))  # noqa: B023
            timed = Comparison(seconds)
            rates = {name: 2 * m * k * n / s / 1e12 for name, s in timed.medians.items()}
            ratio = timed.speed_ratio(pick, timed.fastest())
            worst = min(worst, ratio)
            print(
                f"| {m} {k} {n} | {rates['cublas']:.0f} | {rates['cublasLt']:.0f} | "
                f"{rates[pick]:.0f} ({pick}) | {ratio:.3f} |",
                flush=True,
            )
        print(f"\nworst auto / fastest ({dtype}): {worst:.3f}")


def _pick() -> str:
    """auto's pick, as the library it runs ("default" is PyTorch's startup library)."""
    from xpuruntime.pytorch._selection import _policy

    chosen = _policy.current_state().decisions["matmul"].chosen
    if chosen == "default":
        chosen = {"cublas": "cublas", "cublaslt": "cublasLt"}[_policy._base.blas or "cublas"]
    return chosen


if __name__ == "__main__":
    main()

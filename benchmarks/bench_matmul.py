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
from xpuruntime.pytorch._timing import time_call

SHAPES = [  # (M, K, N): square, GPT-2 124M projections at 16k tokens, LM head
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 768, 2304),
    (16384, 768, 3072),
    (16384, 3072, 768),
    (16384, 768, 50304),
    (1024, 1024, 1024),
]


def main() -> None:
    device = torch.device("cuda")
    os.environ["XPURUNTIME_CACHE_DIR"] = tempfile.mkdtemp()
    xpt.set_kernel_policy(auto_strategy="best_performance")
    pick = _pick()
    xpt.clear_kernel_policy()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; auto picks {pick}")
    for dtype in (torch.bfloat16, torch.float32):
        print(f"\n{dtype}: TFLOP/s" + (" (TF32 off)" if dtype == torch.float32 else ""))
        print("| M K N | cublas | cublasLt | auto | auto / fastest |")
        print("| --- | --- | --- | --- | --- |")
        for m, k, n in SHAPES:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            rates = dict.fromkeys(("cublas", "cublasLt"), 0.0)
            # Interleaved rounds in alternating order, best round kept: a GPU under
            # sustained load clocks down, which would otherwise favour whichever runs first.
            for round_ in range(6):
                for kernel in sorted(rates, reverse=bool(round_ % 2)):
                    with xpt.kernel_policy(matmul=kernel, tf32=False, strict=True):
                        seconds = time_call(lambda: a @ b, device)  # noqa: B023
                    rates[kernel] = max(rates[kernel], 2 * m * k * n / seconds / 1e12)
            auto = rates[pick]
            best = max(rates["cublas"], rates["cublasLt"])
            print(
                f"| {m} {k} {n} | {rates['cublas']:.0f} | {rates['cublasLt']:.0f} | "
                f"{auto:.0f} ({pick}) | {auto / best:.3f} |",
                flush=True,
            )


def _pick() -> str:
    from xpuruntime.pytorch._policy import current_state

    return current_state().decisions["matmul"].chosen


if __name__ == "__main__":
    main()

"""Block sizes for our Triton attention: each candidate (BLOCK_M, BLOCK_N, warps, stages)
per kernel, timed at B4 H16 S4096 (bf16), others at their defaults. Prints ms per
candidate; the winners go into flash_attention._blocks by hand (and the table into
BENCHMARKS.md).

    python benchmarks/tune_flash_attention.py
"""

import torch
from triton.testing import do_bench

from xpuruntime.pytorch._ops import flash_attention as fa

CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (128, 32, 4, 3), (64, 128, 4, 3), (128, 64, 8, 4)],
    "dkdv": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3),
             (16, 128, 4, 3), (32, 128, 8, 2), (64, 128, 4, 2)],
    "dq": [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3),
           (128, 128, 8, 2), (128, 32, 4, 3)],
}  # fmt: skip


def _runner(kernel, q, k, v, do, o, lse, grads, causal):
    scale = q.shape[-1] ** -0.5
    fa.attention_forward(q, k, v, causal, scale, o, lse)
    if kernel == "fwd":
        return lambda: fa.attention_forward(q, k, v, causal, scale, o, lse)
    return lambda: fa.attention_backward(do, q, k, v, o, lse, causal, scale, *grads)


def main() -> None:
    default = fa._blocks
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, ms (median)")
    for d in (128, 64):
        b, h, s = 4, 2048 // d, 4096
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        for causal in (False, True):
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            for kernel, candidates in CANDIDATES.items():
                cells = []
                for config in candidates:
                    fa._blocks = lambda head_dim, kernel=kernel, config=config: {
                        **default(head_dim),
                        kernel: config,
                    }
                    try:
                        fn = _runner(kernel, q, k, v, do, o, lse, grads, causal)
                        fn()
                        cells.append(f"{config}: {do_bench(fn, return_mode='median'):.3f}")
                    except Exception as e:  # out of shared memory, registers, ...
                        cells.append(f"{config}: {type(e).__name__}")
                    finally:
                        fa._blocks = default
                print(f"D{d} causal={causal} {kernel}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()

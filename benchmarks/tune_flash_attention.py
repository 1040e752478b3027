"""Block sizes for our Triton attention: each candidate (BLOCK_M, BLOCK_N, warps, stages)
per kernel, timed at B4 H16 S4096 (bf16), others at their defaults. Then over packed
documents at Llama-3.2-1B's shape (B4 S2048, 32 query and 8 key heads of 64, documents
of 512). Prints ms per candidate; the winners go into flash_attention._blocks by hand
(and the table into BENCHMARKS.md).

    python benchmarks/tune_flash_attention.py [--documents]   (--documents: only those)
    python benchmarks/tune_flash_attention.py --wide   (head_dim 256 alone: Gemma3-1B's
        B4 S2048, 4 query heads and 1 key head, causal and in its sliding window of 512)
"""

import sys

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
WIDE = {  # head_dim 256: tiles and fp32 accumulators twice as wide, so smaller blocks
    "fwd": [(64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 3), (128, 32, 8, 2), (64, 64, 4, 2),
            (128, 64, 8, 2), (32, 64, 4, 2)],
    "dkdv": [(32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 3), (32, 64, 4, 1),
             (64, 64, 8, 1), (16, 128, 8, 2)],
    "dq": [(64, 32, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 1),
           (128, 32, 8, 2)],
}  # fmt: skip


def _runner(kernel, q, k, v, do, o, lse, grads, causal, bounds=(None, None)):
    scale = q.shape[-1] ** -0.5
    fa.attention_forward(q, k, v, causal, scale, o, lse, bounds[0])
    if kernel == "fwd":
        return lambda: fa.attention_forward(q, k, v, causal, scale, o, lse, bounds[0])
    return lambda: fa.attention_backward(do, q, k, v, o, lse, causal, scale, *grads, *bounds)


def _tune(label, q, k, v, causal, bounds=(None, None), candidates=CANDIDATES) -> None:
    """Each kernel's candidates, the others at their defaults, printed on a line each."""
    default = fa._blocks
    do, o = torch.randn_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for kernel, configs in candidates.items():
        cells = []
        for config in configs:
            fa._blocks = lambda head_dim, documents=False, kernel=kernel, config=config: {
                **default(head_dim, documents),
                kernel: config,
            }
            try:
                fn = _runner(kernel, q, k, v, do, o, lse, grads, causal, bounds)
                fn()
                cells.append(f"{config}: {do_bench(fn, return_mode='median'):.3f}")
            except Exception as e:  # out of shared memory, registers, ...
                cells.append(f"{config}: {type(e).__name__}")
            finally:
                fa._blocks = default
        print(f"{label} {kernel}: " + "; ".join(cells), flush=True)


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, ms (median)")
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    if "--wide" in sys.argv:
        q = torch.randn(4, 4, 2048, 256, **bf16)
        k, v = (torch.randn(4, 1, 2048, 256, **bf16) for _ in range(2))
        _tune("D256 causal", q, k, v, True, candidates=WIDE)
        row = torch.zeros(4, 2048, dtype=torch.int32, device="cuda")
        bounds = fa.document_bounds(row, window=512)
        _tune("D256 window 512", q, k, v, True, bounds, candidates=WIDE)
        return
    for d in (128, 64) if "--documents" not in sys.argv else ():
        q, k, v = (torch.randn(4, 2048 // d, 4096, d, **bf16) for _ in range(3))
        for causal in (False, True):
            _tune(f"D{d} causal={causal}", q, k, v, causal)
    q = torch.randn(4, 32, 2048, 64, **bf16)
    k, v = (torch.randn(4, 8, 2048, 64, **bf16) for _ in range(2))
    documents = (torch.arange(2048, device="cuda") // 512).expand(4, -1)
    _tune("D64 documents of 512", q, k, v, True, fa.document_bounds(documents))


if __name__ == "__main__":
    main()

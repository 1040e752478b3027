"""Launch parameters for the norm kernels: warps for the forward, warps and programs per
SM for the persistent backward, at bf16 rows x hidden = 32768 x 4096 elements. Prints
GB/s (forward: read x + write y) and ms; the winners go into ops._launch by hand.
``--heads``: instead the RMSNorm forward's rows a program and warps over per-head q/k
norms' rows (8192 tokens, read in place from a joined q/k/v output, as Qwen3's and
Gemma3's are), GB/s of reading them and writing the output and the dense copy the
backward keeps.

    python benchmarks/tune_norms.py [--heads]
"""

import importlib
import sys

import torch
import triton
from triton.testing import do_bench

from xpuruntime.pytorch._ops._infra._launch import _sm_count

# The module (the package's attribute of that name is the function).
ln = importlib.import_module("xpuruntime.pytorch._ops.fused_layernorm")
rms = importlib.import_module("xpuruntime.pytorch._ops.fused_rmsnorm")


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    if "--heads" in sys.argv:
        for heads, n in ((16, 128), (8, 128), (4, 256), (32, 64)):
            tune_heads(heads, n)
        return
    for n in (1024, 2048, 4096, 8192, 16384):
        tune(n)


def tune(n: int) -> None:
    sms = _sm_count(0)
    m = 32768 * 4096 // n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
    mean = torch.empty(m, device="cuda", dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block = triton.next_power_of_2(n)
    cells = []
    for warps in (2, 4, 8, 16, 32):
        if block // (32 * warps) < 1:
            continue

        def fwd(warps=warps):
            ln._layernorm_fwd[(m,)](
                x, y, w, b, mean, rstd, x.stride(0), y.stride(0), n, 1e-5,
                HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_N=block, num_warps=warps,
            )  # fmt: skip

        ms = do_bench(fwd, return_mode="median")
        cells.append(f"{warps}w {4 * m * n / ms / 1e6:.0f}")
    print(f"fwd {m}x{n} GB/s: " + ", ".join(cells), flush=True)
    cells = []
    for warps in (4, 8, 16):
        for per_sm in (1, 2, 4, 8):
            programs = min(m, per_sm * sms)
            per_program = triton.cdiv(m, programs)
            programs = triton.cdiv(m, per_program)
            dw = torch.empty((programs, n), device="cuda", dtype=torch.float32)
            db = torch.empty_like(dw)

            def bwd(warps=warps, programs=programs, per_program=per_program, dw=dw, db=db):
                ln._layernorm_bwd[(programs,)](
                    dy, x, w, mean, rstd, dx, dw, db, dy.stride(0), x.stride(0),
                    dx.stride(0), m, n, per_program, HAS_WEIGHT=True, HAS_BIAS=True,
                    BLOCK_N=block, num_warps=warps,
                )  # fmt: skip
                dw.sum(0)
                db.sum(0)

            try:
                cells.append(f"{warps}w/{per_sm} {do_bench(bwd, return_mode='median'):.3f}")
            except Exception as e:  # out of registers / shared memory
                cells.append(f"{warps}w/{per_sm} {type(e).__name__}")
    print(f"bwd {m}x{n} ms: " + ", ".join(cells), flush=True)


def tune_heads(heads: int, n: int, tokens: int = 8192) -> None:
    """The forward over ``heads`` rows of ``n`` a token, each program taking 1-64 rows."""
    joined = torch.randn(tokens, 3 * heads * n, device="cuda", dtype=torch.bfloat16)
    x = joined[:, : heads * n].view(tokens, heads, n)
    m = tokens * heads
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y, dense = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rstd = torch.empty(m, device="cuda", dtype=torch.float32)
    cells = []
    for rows in (1, 4, 8, 16, 32, 64):
        for warps in (1, 2, 4, 8):
            if rows * n < 32 * warps:
                continue

            def fwd(rows=rows, warps=warps):
                rms._rmsnorm_fwd[(triton.cdiv(m, rows),)](
                    x, x, dense, y, w, rstd, x.stride(-2), y.stride(0), m, n, 1e-6,
                    1, heads, x.stride(0), 0, HAS_WEIGHT=True, HAS_RESIDUAL=False,
                    STATS=True, GROUPED=True, BLOCK_N=triton.next_power_of_2(n),
                    BLOCK_M=rows, num_warps=warps,
                )  # fmt: skip

            ms = do_bench(fwd, return_mode="median")
            cells.append(f"{rows}r{warps}w {3 * 2 * m * n / ms / 1e6:.0f}")
    print(f"fwd {tokens}x{heads}x{n} GB/s: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()

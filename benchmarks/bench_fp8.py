"""FP8 GEMMs against bf16 at the shapes of a Llama training step, casts included (GPU,
compute capability >= 8.9).

For each linear layer of the Llama-3.2-1B and Llama-3.1-8B shapes (q/k/v and gate/up
joined as ``optimize`` joins them) and 8192 tokens, the three GEMMs of a training step
(forward, input gradient, weight gradient) in bf16 and through ``torch._scaled_mm``
with operands in e4m3 (gradients e5m2, as torchao's tensorwise recipe), tensorwise and
rowwise scaled. "fp8 + casts" adds what a step must also pay: each operand's amax and
its cast (and the transposed copies the layouts need). The ratio says where FP8 pays.

    python benchmarks/bench_fp8.py
"""

import torch
from triton.testing import do_bench

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
TOKENS = 8192
SHAPES = {  # name: (K, N) of the layer's weight (N, K)
    "1b qkv": (2048, 3072),
    "1b o": (2048, 2048),
    "1b gate/up": (2048, 16384),
    "1b down": (8192, 2048),
    "8b qkv": (4096, 6144),
    "8b o": (4096, 4096),
    "8b gate/up": (4096, 28672),
    "8b down": (14336, 4096),
}


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _tensorwise(t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def _rowwise(t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.finfo(dtype).max / t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def _row(name: str, k: int, n: int) -> str:
    dev = "cuda"
    x = torch.randn(TOKENS, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(TOKENS, n, device=dev, dtype=torch.bfloat16)
    bf16 = _ms(lambda: x @ w.t()) + _ms(lambda: dy @ w) + _ms(lambda: dy.t() @ x)

    # tensorwise: forward x @ w^T; dgrad dy @ w (w's transposed copy); wgrad dy^T @ x.
    xq, sx = _tensorwise(x, E4M3)
    wq, sw = _tensorwise(w, E4M3)
    wtq = wq.t().contiguous().t()  # (K, N) column-major for dgrad
    dyq, sdy = _tensorwise(dy, E5M2)
    dytq = dyq.t().contiguous()  # (N, M) row-major for wgrad
    xtq = xq.t().contiguous().t()  # (M, K) column-major for wgrad
    mm = torch._scaled_mm
    gemms = (
        _ms(lambda: mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
        + _ms(lambda: mm(dyq, wtq, scale_a=sdy, scale_b=sw, out_dtype=torch.bfloat16))
        + _ms(lambda: mm(dytq, xtq, scale_a=sdy, scale_b=sx, out_dtype=torch.bfloat16))
    )
    casts = (
        _ms(lambda: _tensorwise(x, E4M3))
        + _ms(lambda: _tensorwise(w, E4M3))
        + _ms(lambda: _tensorwise(dy, E5M2))
        + _ms(lambda: xq.t().contiguous())
        + _ms(lambda: dyq.t().contiguous())
        + _ms(lambda: wq.t().contiguous())
    )

    # rowwise (e4m3 throughout, as torchao's rowwise): per-row scales of each operand
    # along its contraction dimension.
    xr, rx = _rowwise(x, E4M3)
    wr, rw = _rowwise(w, E4M3)
    rowwise_fwd = _ms(lambda: mm(xr, wr.t(), scale_a=rx, scale_b=rw.t(), out_dtype=torch.bfloat16))
    rowwise_fwd_casts = _ms(lambda: _rowwise(x, E4M3)) + _ms(lambda: _rowwise(w, E4M3))
    fwd_bf16 = _ms(lambda: x @ w.t())
    return (
        f"| {name} | {k}x{n} | {bf16:.3f} | {gemms:.3f} ({bf16 / gemms:.2f}x) | "
        f"{gemms + casts:.3f} ({bf16 / (gemms + casts):.2f}x) | "
        f"{fwd_bf16 / rowwise_fwd:.2f}x / {fwd_bf16 / (rowwise_fwd + rowwise_fwd_casts):.2f}x |"
    )


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens")
    print(
        "| layer | K x N | bf16 fwd+dgrad+wgrad ms | tensorwise fp8 GEMMs | "
        "fp8 + casts (unfused) | rowwise fwd: GEMM / + casts |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (k, n) in SHAPES.items():
        print(_row(name, k, n), flush=True)


if __name__ == "__main__":
    main()

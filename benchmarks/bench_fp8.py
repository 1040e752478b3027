"""FP8 GEMMs against bf16 at the shapes of a Llama training step, casts included (GPU,
compute capability >= 8.9).

For each linear layer of the Llama-3.2-1B and Llama-3.1-8B shapes (q/k/v and gate/up
joined as ``optimize`` joins them) and 8192 tokens, the three GEMMs of a training step
(forward, input gradient, weight gradient) in bf16 and through ``torch._scaled_mm``
with operands in e4m3 (gradients e5m2, as torchao's tensorwise recipe), tensorwise and
rowwise scaled. "fp8 + casts" adds what a step must also pay: each operand's amax and
its cast (and the transposed copies the layouts need), as torch ops; the last columns
time ``ops.fp8.fp8_linear`` (our fused casts) against ``F.linear``, forward and backward.

    python benchmarks/bench_fp8.py
"""

import torch
from triton.testing import do_bench

from xpuruntime.pytorch._ops import fp8

E4M3, E5M2 = fp8.E4M3, fp8.E5M2
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

    # The op as a step runs it: casts, amaxes and GEMMs, forward and backward.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    op = {"bf16": lambda: _train(torch.nn.functional.linear, xg, wg, dy)}
    for recipe in fp8.RECIPES:
        op[recipe] = lambda r=recipe: _train(lambda a, b: fp8.fp8_linear(a, b, None, r), xg, wg, dy)
    times = {name: _ms(run) for name, run in op.items()}
    return (
        f"| {name} | {k}x{n} | {bf16:.3f} | {gemms:.3f} ({bf16 / gemms:.2f}x) | "
        f"{gemms + casts:.3f} ({bf16 / (gemms + casts):.2f}x) | {times['bf16']:.3f} | "
        f"{times['tensorwise']:.3f} ({times['bf16'] / times['tensorwise']:.2f}x) | "
        f"{times['rowwise']:.3f} ({times['bf16'] / times['rowwise']:.2f}x) |"
    )


def _train(linear, x, w, dy) -> None:
    x.grad = w.grad = None
    linear(x, w).backward(dy)


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens")
    print(
        "| layer | K x N | bf16 fwd+dgrad+wgrad ms | tensorwise fp8 GEMMs | fp8 + casts "
        "(unfused, torch ops) | F.linear fwd+bwd | fp8_linear tensorwise | fp8_linear rowwise |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (k, n) in SHAPES.items():
        print(_row(name, k, n), flush=True)


if __name__ == "__main__":
    main()

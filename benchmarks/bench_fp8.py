"""FP8 GEMMs against bf16 at the shapes of a Llama training step, casts included (GPU,
compute capability >= 8.9).

For each linear layer of the Llama-3.2-1B and Llama-3.1-8B shapes (q/k/v and gate/up
joined as ``optimize`` joins them) and 8192 tokens, the three GEMMs of a training step
(forward, input gradient, weight gradient) in bf16 and through ``torch._scaled_mm``
with operands in e4m3 (gradients e5m2, as torchao's tensorwise recipe), tensorwise and
rowwise scaled. "fp8 + casts" adds what a step must also pay: each operand's amax and
its cast (and the transposed copies the layouts need), as torch ops; the last columns
time ``ops.fp8.fp8_linear`` (our fused casts) against ``F.linear``, forward and backward.

The second table is a frozen base's two GEMMs (LoRA's: forward and input gradient, no
weight gradient): bf16, FP8 with the weight cast per call (``output_gemm`` and
``input_grad_gemm``, tensorwise), and a weight stored once in FP8 (``fp8_base``:
``stored_output_gemm`` and ``stored_input_grad_gemm``), with the stored path's own
parts: the input's per-token cast, the output gradient's folded per-token cast, the
stored bytes' transpose.

The third is the gated MLP's activation with gate and up kept in FP8
(``fp8_activations``) over bases stored in FP8, with and without the casts it hands the
projections around it (``_fp8_handoff``): forward, the activation then ``h``'s per-token
cast, against the activation writing that cast; backward, the activation's gradient then
its folded per-token cast (``fp8.quantize``: an amax pass, then a cast pass), against
the activation finding each row's amax and the cast reading the gradient once.

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


def _operands(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's input (TOKENS, k), weight (n, k) and output gradient, bf16 on the GPU."""
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
    return x, w, dy


def _row(name: str, k: int, n: int) -> str:
    x, w, dy = _operands(k, n)
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


def _frozen_row(name: str, k: int, n: int) -> str:
    from xpuruntime.pytorch._ops._infra._fp8_weight import quantize_rows

    x, w, dy = _operands(k, n)
    qdata, scale = quantize_rows(w)
    bf16 = _ms(lambda: x @ w.t()) + _ms(lambda: dy @ w)
    cast = _ms(lambda: fp8.output_gemm(x, w, "tensorwise")) + _ms(
        lambda: fp8.input_grad_gemm(dy, w, "tensorwise")
    )
    stored = _ms(lambda: fp8.stored_output_gemm(x, qdata, scale)) + _ms(
        lambda: fp8.stored_input_grad_gemm(dy, qdata, scale)
    )
    x_cast = _ms(lambda: fp8.quantize(x, E4M3, "row"))
    dy_cast = _ms(lambda: fp8.quantize(dy, E4M3, "row", multiplier=scale))
    transpose = _ms(lambda: fp8.transposed(qdata))
    return (
        f"| {name} | {k}x{n} | {bf16:.3f} | {cast:.3f} ({bf16 / cast:.2f}x) | "
        f"**{stored:.3f} ({bf16 / stored:.2f}x)** | {x_cast:.3f} | {dy_cast:.3f} | "
        f"{transpose:.3f} |"
    )


MLPS = {"1b": 8192, "8b": 14336}  # the MLPs' intermediate sizes


def _handoff_row(name: str, n: int) -> str:
    from xpuruntime.pytorch._ops import swiglu as gated

    bf16 = torch.bfloat16
    pair = torch.randn(TOKENS, 2 * n, device="cuda", dtype=bf16)
    dh = torch.randn(TOKENS, n, device="cuda", dtype=bf16)
    scale = torch.rand(2 * n, device="cuda") * 1e-3  # (a stored base's row scales)
    h, kept, _ = gated._kept_forward(False, pair, None, False)
    forward = _ms(lambda: gated._kept_forward(False, pair, None, False))
    apart_fwd = forward + _ms(lambda: fp8.quantize(h, E4M3, "row"))
    fused_fwd = _ms(lambda: gated._kept_forward(False, pair, None, True))

    def backward(multipliers):
        return gated._kept_backward(False, dh, pair.shape, bf16, kept, multipliers)

    dg, _, _ = backward(None)
    plain = _ms(lambda: backward(None))
    apart_bwd = plain + _ms(lambda: fp8.quantize(dg, E4M3, "row", multiplier=scale))
    dg, _, parts = backward(scale)
    fused_bwd = _ms(lambda: backward(scale)) + _ms(
        lambda: fp8.quantize(dg, E4M3, "row", multiplier=scale, amax=parts)
    )
    return (
        f"| {name} | {TOKENS}x2x{n} | {apart_fwd:.3f} | **{fused_fwd:.3f}** | {plain:.3f} | "
        f"{apart_bwd:.3f} | **{fused_bwd:.3f}** | "
        f"{1000 * (apart_fwd + apart_bwd - fused_fwd - fused_bwd):.0f} |"
    )


def _train(linear, x, w, dy) -> None:
    x.grad = w.grad = None
    linear(x, w).backward(dy)


def _table(columns: list[str], row) -> None:
    """A table of ``row(name, k, n)`` for every shape, under ``columns``."""
    print("| " + " | ".join(columns) + " |")
    print("| --- | --- |" + " ---: |" * (len(columns) - 2))
    for name, (k, n) in SHAPES.items():
        print(row(name, k, n), flush=True)


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens")
    _table(["layer", "K x N", "bf16 fwd+dgrad+wgrad ms", "tensorwise fp8 GEMMs",
            "fp8 + casts (unfused, torch ops)", "F.linear fwd+bwd", "fp8_linear tensorwise",
            "fp8_linear rowwise"], _row)  # fmt: skip
    print()
    _table(["frozen base", "K x N", "bf16 fwd+dgrad ms", "fp8, weight cast per call",
            "fp8, stored (fp8_base)", "its input cast", "its dY cast", "its transpose"],
           _frozen_row)  # fmt: skip
    print()
    columns = ["MLP", "gate/up", "fwd: activation, then h's cast", "fwd: one launch",
               "bwd: activation alone", "bwd: activation, then dY's cast",
               "bwd: amax handed, cast once", "saved us"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("| --- | --- |" + " ---: |" * (len(columns) - 2))
    for name, n in MLPS.items():
        print(_handoff_row(name, n), flush=True)


if __name__ == "__main__":
    main()

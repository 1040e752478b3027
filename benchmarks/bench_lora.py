"""The lora_linear op on one GPU, forward and backward, at Llama-3.2-1B's shapes (B4 x
T2048, bf16, rank 16): our fused node against peft's chain as written (the ``torch``
kernel), with and without dropout (0.05, TRL's default), for a q/k/v group, o_proj's
single layer and down_proj's wide input. Then, for down_proj after a SwiGLU, its
adapter's gradient ``ds^T h`` read from gate and up by the activation's kernel against
``h`` made again and a GEMM (what the op did before), at Llama-3.2-1B's and
Llama-3.1-8B's MLP widths. Then, at Llama-3.2's 1B and 3B and Llama-3.1-8B's widths,
the base's GEMM with the adapters' term added in a second pass, against the term made
first with the base's GEMM adding onto it by its beta (what the op's input gradient
does), and one GEMM over a contraction r longer (folding the term in: not built).
Last, the host's own time per forward and backward call (64 tokens, so that the GPU
never holds the host up): the op against peft's chain, and single PyTorch calls the op
is made of. On a GPU with FP8, the same for the op with FP8 GEMMs (the base cast on each
call, and stored once) and the single calls those add. A plain training loop whose host
is slower than its GPU waits for that time.

Usage: python benchmarks/bench_lora.py [--tokens 8192] [--rank 16] [--host-only]
"""

from __future__ import annotations

import argparse
import time

import torch
from triton.testing import do_bench

from xpuruntime.pytorch._ops.lora_linear import lora_projections, torch_lora_projections

SHAPES = {  # name: (input width, each layer's output width)
    "q/k/v": (2048, (2048, 512, 512)),
    "o_proj": (2048, (2048,)),
    "down_proj": (8192, (2048,)),
}


def case(tokens: int, width: int, outs: tuple[int, ...], rank: int, dropout: float):
    """Inputs as an adapted model has them: fp32 weights, the base frozen, bf16 autocast."""
    x = torch.randn(tokens, width, device="cuda", requires_grad=True)
    weights = tuple(torch.randn(o, width, device="cuda") * width**-0.5 for o in outs)
    lora_as = tuple((torch.randn(rank, width, device="cuda") * width**-0.5).requires_grad_()
                    for _ in outs)  # fmt: skip
    lora_bs = tuple(torch.randn(o, rank, device="cuda").requires_grad_() for o in outs)
    drops = tuple((dropout, torch.float32) for _ in outs) if dropout else ()
    grads = [torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16) for o in outs]
    return x, weights, lora_as, lora_bs, drops, grads


def timed(fn, x, weights, lora_as, lora_bs, drops, grads) -> float:
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            outs = fn(x, weights, (), lora_as, lora_bs, (2.0,) * len(weights), None, drops)
        torch.autograd.backward(outs, grads)

    return do_bench(step, warmup=10, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--host-only", action="store_true", help="only the host-time tables")
    parser.add_argument(
        "--host-profile", type=int, default=0,
        help="with --host-only: this many top Python functions of o_proj's call, bf16 and FP8",
    )  # fmt: skip
    args = parser.parse_args()
    if args.host_only:
        host_costs(args.rank, args.host_profile)
        return
    print(f"# {torch.cuda.get_device_name()}, {args.tokens} tokens, rank {args.rank}, "
          "bf16 autocast, forward + backward, ms (median)")  # fmt: skip
    print("| layers | dropout | peft's chain | ours | ours vs chain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (width, outs) in SHAPES.items():
        for dropout in (0.0, 0.05):
            inputs = case(args.tokens, width, outs, args.rank, dropout)
            chain = timed(torch_lora_projections, *inputs)
            ours = timed(lora_projections, *inputs)
            print(f"| {name} | {dropout} | {chain:.3f} | {ours:.3f} | {chain / ours:.2f}x |")
    print()
    print("| down_proj's dA after SwiGLU | h made again + GEMM | from gate and up | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for width in (8192, 14336):
        again, product = gated_adapter_grad(args.tokens, width, args.rank)
        print(f"| {args.tokens} x {width} | {again:.3f} | {product:.3f} | {again / product:.2f}x |")
    print()
    folded_adapter_terms(args.rank)
    print()
    host_costs(args.rank)


FOLDED = {  # name: (tokens, input width, output width), Llama-3.2's 1B and 3B, Llama-3.1-8B
    "1B q/k/v": (8192, 2048, 3072),
    "1B gate/up": (8192, 2048, 16384),
    "1B down": (8192, 8192, 2048),
    "3B q/k/v": (8192, 3072, 5120),
    "3B gate/up": (8192, 3072, 16384),
    "3B down": (8192, 8192, 3072),
    "8B q/k/v": (4096, 4096, 6144),
    "8B gate/up": (4096, 4096, 28672),
    "8B down": (4096, 14336, 4096),
}


def folded_adapter_terms(rank: int) -> None:
    """What folding the adapters' term into the base's GEMM would save, before anything is
    built on it. The op adds ``t (sB)^T`` to the base's output in a second pass
    (``addmm_``: the output read and written again). It adds ``(dY sB) A`` to the input
    gradient so too. One GEMM over a contraction r longer does both at once:
    ``[x | t] [W | sB]^T`` and ``[dY | dY sB] [W ; A]``, the operands strided views of
    buffers one row (or column) block wider. Without wider buffers the term can be made
    first, and the base's GEMM add onto it by its beta (the output read in its epilogue,
    not by a pass of its own). ms, bf16, median; the others are checked against the two
    passes."""
    print(f"| GEMM (rank {rank}) | forward: GEMM + addmm_ | term first | folded | ratio "
          "| input gradient: GEMM + addmm_ | term first | folded | ratio |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    bf16 = torch.bfloat16
    for name, (tokens, k, n) in FOLDED.items():
        x_wide = torch.randn(tokens, k + rank, device="cuda", dtype=bf16)
        w_wide = torch.randn(n, k + rank, device="cuda", dtype=bf16) * k**-0.5
        # (the op's own operands are contiguous: the folded GEMMs' views copied)
        x, t = x_wide[:, :k].contiguous(), x_wide[:, k:].contiguous()
        w, sb = w_wide[:, :k].contiguous(), w_wide[:, k:].contiguous()
        dy_wide = torch.randn(tokens, n + rank, device="cuda", dtype=bf16)
        w_tall = torch.randn(n + rank, k, device="cuda", dtype=bf16) * n**-0.5
        dy, g = dy_wide[:, :n].contiguous(), dy_wide[:, n:].contiguous()
        w_rows, a = w_tall[:n], w_tall[n:]  # (row blocks of a contiguous tensor)

        def two_pass_forward(x=x, w=w, t=t, sb=sb):
            return torch.mm(x, w.t()).addmm_(t, sb.t())

        def two_pass_grad(dy=dy, w_rows=w_rows, g=g, a=a):
            return torch.mm(dy, w_rows).addmm_(g, a)

        def term_first_forward(x=x, w=w, t=t, sb=sb):  # (the GEMM's beta reads it)
            return torch.mm(t, sb.t()).addmm_(x, w.t())

        def term_first_grad(dy=dy, w_rows=w_rows, g=g, a=a):
            return torch.mm(g, a).addmm_(dy, w_rows)

        def folded_forward(x_wide=x_wide, w_wide=w_wide):
            return torch.mm(x_wide, w_wide.t())

        def folded_grad(dy_wide=dy_wide, w_tall=w_tall):
            return torch.mm(dy_wide, w_tall)

        forward = (two_pass_forward, term_first_forward, folded_forward)
        grad = (two_pass_grad, term_first_grad, folded_grad)
        for two, *others in (forward, grad):
            for other in others:
                torch.testing.assert_close(other(), two(), rtol=2e-2, atol=2e-2)
        fw = [do_bench(fn, warmup=10, rep=100, return_mode="median") for fn in forward]
        bw = [do_bench(fn, warmup=10, rep=100, return_mode="median") for fn in grad]
        print(f"| {name} ({tokens} x {k} -> {n}) | {fw[0]:.3f} | {fw[1]:.3f} | {fw[2]:.3f} | "
              f"{fw[0] / fw[1]:.2f}x, {fw[0] / fw[2]:.2f}x | {bw[0]:.3f} | {bw[1]:.3f} | "
              f"{bw[2]:.3f} | {bw[0] / bw[1]:.2f}x, {bw[0] / bw[2]:.2f}x |")  # fmt: skip


def gated_adapter_grad(tokens: int, width: int, rank: int) -> tuple[float, float]:
    """ms of ``ds^T h`` (fp32) for ``h = silu(gate) * up``: made again then one GEMM,
    against the activation's left product."""
    from xpuruntime.pytorch._ops import swiglu

    gate, up = (torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) for _ in "gu")
    ds = torch.randn(tokens, rank, device="cuda", dtype=torch.bfloat16)
    again = swiglu._AGAIN["swiglu"]
    product = swiglu._PRODUCTS["swiglu"]
    torch.testing.assert_close(
        product(ds, gate, up), torch.mm(ds.t(), again(gate, up)[0], out_dtype=torch.float32),
        rtol=2e-2, atol=1e-1,
    )  # fmt: skip
    made = do_bench(lambda: torch.mm(ds.t(), again(gate, up)[0], out_dtype=torch.float32))
    read = do_bench(lambda: product(ds, gate, up))
    return made, read


def host_us(fn, calls: int = 300) -> float:
    """The host's microseconds per ``fn()`` (median of 5 runs of ``calls`` calls, the GPU
    synchronised only around each run)."""
    for _ in range(20):
        fn()
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - begin) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(runs)[2]


def autocast_off() -> None:
    with torch.autocast("cuda", enabled=False):
        pass


def host_costs(rank: int, profile: int = 0) -> None:
    """Host microseconds per forward + backward call at 64 tokens (the op's and peft's
    chain), then per single PyTorch call of the kinds the op makes (``profile``: the
    FP8 table's o_proj calls under cProfile, this many functions each)."""
    print("# host time per call, us (64 tokens: the GPU is never behind)")
    print("| layers | peft's chain | ours | ours vs chain |")
    print("| --- | ---: | ---: | ---: |")
    for name, (width, outs) in SHAPES.items():
        inputs = case(64, width, outs, rank, 0.0)

        def step(fn, inputs=inputs):
            x, weights, lora_as, lora_bs, drops, grads = inputs
            with torch.autocast("cuda", torch.bfloat16):
                outs = fn(x, weights, (), lora_as, lora_bs, (2.0,) * len(weights), None, drops)
            torch.autograd.backward(outs, grads)

        chain = host_us(lambda: step(torch_lora_projections))
        ours = host_us(lambda: step(lora_projections))
        print(f"| {name} | {chain:.0f} | {ours:.0f} | {chain / ours:.2f}x |")
    fp8_host_costs(rank, profile)
    a = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 16, device="cuda", dtype=torch.bfloat16)
    f = torch.randn(16, 2048, device="cuda")
    nothing = a.new_empty(())
    g = torch.empty(48, 2048, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(64, 16, device="cuda", dtype=torch.bfloat16)
    calls = {
        "mm": lambda: a @ b,
        "addmm, alpha, new_empty input": lambda: torch.addmm(a.new_empty(()), a, b, beta=0, alpha=2.0),
        "addmm, alpha, kept input": lambda: torch.addmm(nothing, a, b, beta=0, alpha=2.0),
        "mm out_dtype=float32": lambda: torch.mm(a, b, out_dtype=torch.float32),
        "mm then mul_": lambda: (a @ b).mul_(2.0),
        "F.linear": lambda: torch.nn.functional.linear(a, b.t()),
        "cat of 3 (16 x 2048 fp32 each) to bf16": lambda: torch.cat([f, f, f], out=g),
        "mul into a block (out=)": lambda: torch.mul(f, 2.0, out=g[:16]),
        "addmm_ in place": lambda: c.addmm_(a, b),
        ".to(bf16) cast": lambda: f.to(torch.bfloat16),
        ".to(bf16) no-op": lambda: a.to(torch.bfloat16),
        "new_zeros": lambda: a.new_zeros((48, 2048)),
        "view": lambda: a.view(-1, 2048),
        "autocast(enabled=False) entered and left": autocast_off,
    }  # fmt: skip
    print()
    print("| one call | host us |")
    print("| --- | ---: |")
    for what, fn in calls.items():
        print(f"| {what} | {host_us(fn, 2000):.1f} |")


def fp8_host_costs(rank: int, profile: int = 0) -> None:
    """Host microseconds per forward + backward call of the op with FP8 GEMMs (64 tokens,
    bf16 weights as ``--bf16-params`` loads them): the base cast on each call
    (``fp8='tensorwise'``) and stored once (``fp8_base``), against the bf16 op; then the
    single calls a stored base's GEMMs add (``profile``: o_proj's three forms under
    cProfile, this many functions each by their own and by cumulative time)."""
    from xpuruntime.pytorch._ops import fp8
    from xpuruntime.pytorch._ops._infra._fp8_weight import store_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        print("\n(no FP8 on this GPU: its host table is left out)")
        return
    profiles = []  # (recipe, stored, o_proj's cProfile stats)
    print()
    print("| layers | bf16 | FP8, cast per call | FP8, stored base |")
    print("| --- | ---: | ---: | ---: |")
    for name, (width, outs) in SHAPES.items():
        x, weights, lora_as, lora_bs, _, grads = case(64, width, outs, rank, 0.0)
        x = x.detach().to(torch.bfloat16).requires_grad_()
        weights = tuple(torch.nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
                        for w in weights)  # fmt: skip
        stored = tuple(store_fp8(list(weights)))
        lora_as = tuple(a.detach().to(torch.bfloat16).requires_grad_() for a in lora_as)
        lora_bs = tuple(b.detach().to(torch.bfloat16).requires_grad_() for b in lora_bs)

        def step(base, recipe, x=x, lora_as=lora_as, lora_bs=lora_bs, grads=grads):
            outs = lora_projections(x, base, (), lora_as, lora_bs, (2.0,) * len(base),
                                    fp8=recipe)  # fmt: skip
            torch.autograd.backward(outs, grads)

        forms = ((weights, None), (weights, "tensorwise"), (stored, "tensorwise"))
        times = [host_us(lambda b=b, r=r: step(b, r)) for b, r in forms]
        print(f"| {name} | " + " | ".join(f"{t:.0f}" for t in times) + " |")
        if profile and name == "o_proj":
            profiles = [(r or "bf16", b is stored, host_profile(lambda b=b, r=r: step(b, r)))
                        for b, r in forms]  # fmt: skip
    a = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    (q,) = store_fp8([torch.nn.Parameter(torch.randn(2048, 2048, device="cuda"), False)])
    xq, _, sx = fp8.quantize(a, fp8.E4M3, "row")
    scale = q.scale.view(1, -1)
    calls = {
        "quantize per row (one launch)": lambda: fp8.quantize(a, fp8.E4M3, "row"),
        "quantize per row, a multiplier": lambda: fp8.quantize(a, fp8.E4M3, "row", multiplier=q.scale),
        "transposed (one launch)": lambda: fp8.transposed(q.qdata),
        "torch._scaled_mm": lambda: torch._scaled_mm(xq, q.qdata.t(), scale_a=sx, scale_b=scale,
                                                     out_dtype=torch.bfloat16),
        "stored_output_gemm": lambda: fp8.stored_output_gemm(a, q.qdata, q.scale),
        "stored_input_grad_gemm": lambda: fp8.stored_input_grad_gemm(a, q.qdata, q.scale),
    }  # fmt: skip
    print()
    print("| one FP8 call | host us |")
    print("| --- | ---: |")
    for what, fn in calls.items():
        print(f"| {what} | {host_us(fn, 2000):.1f} |")
    for recipe, kept, stats in profiles:
        form = recipe + (", stored base" if kept else "")
        for order in ("tottime", "cumulative"):
            print(f"\n# o_proj, {form}: top {profile} by {order}, 300 calls")
            stats.sort_stats(order).print_stats(profile)


def host_profile(fn, calls: int = 300):
    """``fn`` under cProfile, ``calls`` times after a warm-up: its ``pstats.Stats``."""
    import cProfile
    import pstats
    import sys

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    return pstats.Stats(profiler, stream=sys.stdout)


if __name__ == "__main__":
    main()

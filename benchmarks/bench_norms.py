"""fused_layernorm and fused_rmsnorm against PyTorch, with auto's pick, in one run (GPU).

bf16. Forward GB/s counts one read of x and one write of y; the anchor is a
device-to-device copy of the same bytes, timed in the same run. fwd+bwd runs the forward
and the backward (input, weight and bias gradients). Peak is the memory allocated above
the inputs during fwd+bwd. "auto" is FusedLayerNorm / FusedRMSNorm under
auto_strategy="best_performance" (it measures both kernels once per shape class).
Goals: layernorm 32768x4096 forward >= 85% of the copy bandwidth and fwd+bwd >= 1.3x
F.layer_norm; where ours is > 5% slower, auto picks PyTorch; rmsnorm fwd+bwd >= 2x the
unfused expression.

``--residual``: only the residual add + layer norm table (ops.fused_add_layernorm against
the add followed by F.layer_norm or by our fused_layernorm), fwd+bwd with gradients
reaching both the sum and the norm, as in a pre-norm block. ``--rms``: only the rmsnorm
table. ``--heads``: only the per-head q/k norm table (Qwen3-1.7B's, on the views of one
joined q/k/v projection: ours reading the view in place, ours after a dense copy, as it
ran before, and F.rms_norm). ``--norm-rope``: only the q/k norms with the rotary
embedding (Qwen3-1.7B's and Gemma3-1B's heads, 8192 tokens): our norm on each view then
``ops.rope``, against the two in one op (``_ops.norm_rope``).

    python benchmarks/bench_norms.py [--residual | --rms | --heads | --norm-rope]
"""

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from xpuruntime import pytorch as xpt
from xpuruntime.pytorch._selection._routed import ROUTED_OPS
from xpuruntime.pytorch.ops import (
    FusedLayerNorm,
    FusedRMSNorm,
    fused_add_layernorm,
    fused_layernorm,
    fused_rmsnorm,
)

DTYPE = torch.bfloat16
ELEMENTS = 32768 * 4096


def unfused_rmsnorm(x, shape, w, eps):
    """The expression most models (Llama, Mistral, ...) carry in Python."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def setup(op: str, impl: str, m: int, n: int):
    """(forward, forward+backward) callables for one implementation at (m, n)."""
    x = torch.randn(m, n, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=DTYPE, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=DTYPE, requires_grad=True)
    dy = torch.randn_like(x)
    if op == "layernorm":
        module = FusedLayerNorm(n).cuda().to(DTYPE)
        fns = {
            "torch": lambda: F.layer_norm(x, (n,), w, b),
            "ours": lambda: fused_layernorm(x, (n,), w, b),
            "auto": lambda: module(x),
        }
    else:
        module = FusedRMSNorm(n, eps=1e-6).cuda().to(DTYPE)
        fns = {
            "unfused": lambda: unfused_rmsnorm(x, (n,), w, 1e-6),
            "torch": lambda: F.rms_norm(x, (n,), w, 1e-6),
            "ours": lambda: fused_rmsnorm(x, (n,), w, 1e-6),
            "auto": lambda: module(x),
        }
    fn = fns[impl]

    def forward():
        with torch.no_grad():
            fn()

    def forward_backward():
        fn().backward(dy)

    return forward, forward_backward, [x, w, b, *module.parameters()]


def time_ms(fn, grads) -> float:
    return do_bench(fn, grad_to_none=grads, return_mode="median")


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_gbps(m: int, n: int) -> float:
    src = torch.randn(m, n, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def run(op: str, impls: list[str], m: int, n: int) -> dict:
    """ms forward, ms fwd+bwd and peak MB per implementation, and auto's pick."""
    results = {}
    with xpt.kernel_policy(auto_strategy="best_performance"):
        for impl in impls:
            forward, both, grads = setup(op, impl, m, n)
            both()  # auto resolves (measures) here, outside the timings
            results[impl] = (time_ms(forward, grads), time_ms(both, grads), peak_mb(both))
        # The fwd+bwd signature's decision (the forward-only one is resolved separately).
        picks = [d.chosen for key, d in ROUTED_OPS[op].decisions.items() if key[6]]
        explain = xpt.explain_kernel_policy()
    return {"results": results, "pick": picks[-1] if picks else "?", "explain": explain}


def residual_ms(m: int, n: int, x_dtype, y_dtype, out_dtype) -> dict[str, float]:
    """fwd+bwd ms of h = x + y and n = layer_norm(h), gradients reaching both; replayed
    from a CUDA graph, since at GPT-2 widths one call is shorter than its host work."""
    h_dtype = torch.promote_types(x_dtype, y_dtype)
    x = torch.randn(m, n, device="cuda", dtype=x_dtype, requires_grad=True)
    y = torch.randn(m, n, device="cuda", dtype=y_dtype, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=h_dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=h_dtype, requires_grad=True)
    gh = torch.randn(m, n, device="cuda", dtype=h_dtype)
    gn = torch.randn(m, n, device="cuda", dtype=out_dtype)

    def unfused(norm):
        h = x + y
        return h, norm(h)

    impls = {
        "torch": lambda: unfused(lambda h: F.layer_norm(h, (n,), w, b).to(out_dtype)),
        "ours": lambda: unfused(lambda h: fused_layernorm(h, (n,), w, b, out_dtype=out_dtype)),
        "fused": lambda: fused_add_layernorm(x, y, n, w, b, out_dtype=out_dtype),
    }
    return {
        name: do_bench_cudagraph(
            lambda fn=fn: torch.autograd.grad(fn(), (x, y, w, b), (gh, gn)), return_mode="median"
        )
        for name, fn in impls.items()
    }


def residual_table() -> None:
    print("\n## residual add + layer norm, fwd+bwd ms (speed-up vs add + F.layer_norm)")
    print("| rows x hidden | x + y -> norm dtype | add + F.layer_norm | add + fused_layernorm "
          "| fused_add_layernorm |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    f32, bf16 = torch.float32, torch.bfloat16
    for m, n, dtypes in [(16384, 768, (f32, bf16, bf16)), (16384, 4096, (f32, bf16, bf16)),
                         (16384, 4096, (bf16, bf16, bf16))]:  # fmt: skip
        ms = residual_ms(m, n, *dtypes)
        cells = [f"{ms[k]:.3f} ({ms['torch'] / ms[k]:.2f}x)" for k in ("torch", "ours", "fused")]
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        print(f"| {m} x {n} | {names} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    os.environ["XPURUNTIME_CACHE_DIR"] = tempfile.mkdtemp()  # measure afresh
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    if "--residual" in sys.argv[1:]:
        residual_table()
        return
    if "--rms" in sys.argv[1:]:
        rms_table()
        return
    if "--heads" in sys.argv[1:]:
        heads_table()
        return
    if "--norm-rope" in sys.argv[1:]:
        norm_rope_table()
        return
    m, n = 32768, 4096
    copy = copy_gbps(m, n)
    out = run("layernorm", ["torch", "ours", "auto"], m, n)
    r = out["results"]
    moved = 2 * m * n * 2
    print(f"\n## layernorm {m}x{n}; copy of the same bytes: {copy:.0f} GB/s")
    print("| impl | fwd ms | fwd GB/s | % of copy | fwd+bwd ms | fwd+bwd vs torch | peak MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for impl, (fwd, both, peak) in r.items():
        gbps = moved / fwd / 1e6
        print(
            f"| {impl} | {fwd:.3f} | {gbps:.0f} | {100 * gbps / copy:.0f}% | {both:.3f} | "
            f"{r['torch'][1] / both:.2f}x | {peak:.0f} |"
        )
    print(f"auto picked: {out['pick']}")
    print(out["explain"])

    print("\n## layernorm sweep (rows x hidden = 32768 x 4096 elements), fwd+bwd")
    print(
        "| rows x hidden | torch ms | ours ms | ours speed-up | fwd speed-up | auto (pick) | auto / fastest |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for n in (128, 256, 1024, 2048, 3072, 4096, 5120, 8192, 12288, 16384):
        m = ELEMENTS // n
        out = run("layernorm", ["torch", "ours", "auto"], m, n)
        r = out["results"]
        fastest = min(r["torch"][1], r["ours"][1])
        worst = max(worst, r["auto"][1] / fastest - 1)
        print(
            f"| {m} x {n} | {r['torch'][1]:.3f} | {r['ours'][1]:.3f} | "
            f"{r['torch'][1] / r['ours'][1]:.2f}x | {r['torch'][0] / r['ours'][0]:.2f}x | "
            f"{r['auto'][1]:.3f} ({out['pick']}) | {fastest / r['auto'][1]:.3f} |",
            flush=True,
        )
    print(f"worst auto shortfall vs the fastest: {worst * 100:.1f}%")

    rms_table()
    heads_table()
    residual_table()


def heads_table(tokens: int = 8192, d: int = 128, q: int = 16, kv: int = 8) -> None:
    """Qwen3's q and k norms (per head, ``d`` wide, as a model's norm module under a
    policy naming ours) on the (tokens, heads, d) views of one (tokens, (q + 2 kv) d)
    projection output: fwd and fwd+bwd ms, each call's host time included."""
    print(f"\n## per-head rmsnorm on a joined projection's views ({tokens} tokens, {d} wide)")
    print(
        "| heads | F.rms_norm fwd / fwd+bwd | ours on a dense copy | ours on the view | view vs copy |"
    )
    print("| --- | --- | --- | --- | --- |")
    joined = torch.randn(tokens, (q + 2 * kv) * d, device="cuda", dtype=DTYPE, requires_grad=True)
    norm = FusedRMSNorm(d, eps=1e-6).cuda().to(DTYPE)
    for heads, start in ((q, 0), (kv, q * d)):
        view = joined[:, start : start + heads * d].view(tokens, heads, d)
        dy = torch.randn(tokens, heads, d, device="cuda", dtype=DTYPE)
        fns = {
            "torch": lambda v=view: F.rms_norm(v, (d,), norm.weight, 1e-6),
            "copy": lambda v=view: norm(v.contiguous()),
            "view": lambda v=view: norm(v),
        }
        times = {}
        for name, fn in fns.items():
            # A policy of its own per layout: a signature's launch plan takes the layout
            # it was derived from (the other runs the Python launches).
            with xpt.kernel_policy(rmsnorm="fused"):

                def forward(fn=fn):
                    with torch.no_grad():
                        fn()

                def both(fn=fn, dy=dy):
                    fn().backward(dy)

                times[name] = (time_ms(forward, [joined]), time_ms(both, [joined, norm.weight]))
        cells = [f"{f:.3f} / {b:.3f}" for f, b in times.values()]
        ratio = times["copy"][1] / times["view"][1]
        print(f"| {heads} | " + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)


def norm_rope_table(tokens: int = 8192) -> None:
    """q/k norms then the rope, apart and joined, on the (B, H, T, D) views of one
    joined projection, as Qwen3's and Gemma3's attention hands them: fwd and fwd+bwd
    ms, each call's host time included; trained norm weights."""
    print(f"\n## q/k norms and rope, {tokens} tokens (B4 x T{tokens // 4})")
    print("| shape | norms then rope fwd / fwd+bwd | joined fwd / fwd+bwd | joined vs apart |")
    print("| --- | --- | --- | --- |")
    for name, q, kv, d in (("Qwen3-1.7B", 16, 8, 128), ("Gemma3-1B", 4, 1, 256)):
        times = norm_rope_times(4, tokens // 4, q, kv, d)
        cells = [f"{f:.3f} / {b:.3f}" for f, b in times]
        print(f"| {name} | " + " | ".join(cells) + f" | {times[0][1] / times[1][1]:.2f}x |")


def norm_rope_times(batch: int, length: int, q: int, kv: int, d: int) -> list[tuple]:
    """(fwd ms, fwd+bwd ms) of the norms then the rope, then of the joined op."""
    from xpuruntime.pytorch._ops.norm_rope import run_norm_rope
    from xpuruntime.pytorch.ops import rope

    joined = torch.randn(batch, length, (q + 2 * kv) * d, device="cuda", dtype=DTYPE)
    joined.requires_grad_()
    views = [
        joined[..., s : s + h * d].view(batch, length, h, d).transpose(1, 2)
        for s, h in ((0, q), (q * d, kv))
    ]
    weights = [torch.randn(d, device="cuda", dtype=DTYPE, requires_grad=True) for _ in "qk"]
    angle = torch.rand(1, length, d, device="cuda") * 6.28
    cos, sin = angle.cos().to(DTYPE), angle.sin().to(DTYPE)
    grads = [torch.randn_like(v) for v in views]

    def apart():
        normed = [
            fused_rmsnorm(v.transpose(1, 2), (d,), w, eps=1e-6).transpose(1, 2)
            for v, w in zip(views, weights)
        ]
        return rope(*normed, cos, sin)

    def together():
        return [run_norm_rope(v, w, cos, sin, 1e-6) for v, w in zip(views, weights)]

    times = []
    for fn in (apart, together):

        def forward(fn=fn):
            with torch.no_grad():
                fn()

        def both(fn=fn):
            torch.autograd.backward(list(fn()), grads)

        params = [joined, *weights]
        times.append((time_ms(forward, params), time_ms(both, params)))
    return times


def rms_table() -> None:
    """rmsnorm fwd+bwd over widths from a head's (128: Qwen3's and Gemma3's per-head q/k
    norms) to 8192."""
    print("\n## rmsnorm, fwd+bwd ms (speed-up vs the unfused expression), peak MB")
    print("| rows x hidden | unfused | F.rms_norm | ours | auto (pick) |")
    print("| --- | --- | --- | --- | --- |")
    for n in (128, 256, 2048, 4096, 8192):
        m = ELEMENTS // n
        out = run("rmsnorm", ["unfused", "torch", "ours", "auto"], m, n)
        r = out["results"]
        base = r["unfused"][1]
        cells = [
            f"{r[i][1]:.3f} ({base / r[i][1]:.2f}x, {r[i][2]:.0f} MB)"
            for i in ("unfused", "torch", "ours")
        ]
        print(
            f"| {m} x {n} | " + " | ".join(cells) + f" | {r['auto'][1]:.3f} ({out['pick']}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Per-call cost of the PyTorch kernel policy: switches (should be free), fused_attention's
per-call dispatch (goal <= 2 µs), and dispatch logging on vs off.

Small shapes, so the op itself is cheap and the overhead shows; every pair is timed in
interleaved rounds in one run. Host time per call (the GPU is synchronised once per
window, so launch overhead is what is measured on CUDA). The overhead is read from the
fastest window of each side (as ``timeit`` advises: slower windows are other work
interfering); the difference of the median windows is printed next to it, since on a
shared host it moves by several microseconds from run to run.

    python benchmarks/bench_policy_overhead.py [--device cuda] [--calls 2000]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from xpuruntime import pytorch as xpt


def per_call(fn, calls, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def interleaved(pairs, calls, device, rounds=15):
    """Per-call seconds of each callable in alternating windows: {name: (min, median)}."""
    samples = {name: [] for name in pairs}
    for fn in pairs.values():
        per_call(fn, 50, device)
    for _ in range(rounds):
        for name, fn in pairs.items():
            samples[name].append(per_call(fn, calls, device))
    return summarise(samples)


def summarise(samples):
    """{name: [seconds per window]} -> {name: (fastest, median)}."""
    return {name: (min(s), statistics.median(s)) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(64, 64, device=device, dtype=dtype)
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, {args.calls} calls x 15 interleaved rounds")
    print(
        "| what | anchor µs/call (fastest window) | with xpuruntime µs/call | overhead µs "
        "| overhead of the median windows µs |"
    )
    print("| --- | --- | --- | --- | --- |")

    def report(label, times):
        (a_min, a_med), (o_min, o_med) = times["anchor"], times["ours"]
        print(
            f"| {label} | {a_min * 1e6:.2f} | {o_min * 1e6:.2f} | {(o_min - a_min) * 1e6:+.2f} "
            f"| {(o_med - a_med) * 1e6:+.2f} |"
        )

    def row(label, anchor, ours):
        report(label, interleaved({"anchor": anchor, "ours": ours}, args.calls, device))

    # 1. Switches: the same op with and without a policy in force (toggled per window).
    times = {"anchor": [], "ours": []}
    for _ in range(15):
        xpt.clear_kernel_policy()
        times["anchor"].append(per_call(lambda: a @ a, args.calls, device))
        xpt.set_kernel_policy(matmul="default", conv="default")
        times["ours"].append(per_call(lambda: a @ a, args.calls, device))
    xpt.clear_kernel_policy()
    report("mm 64x64, policy in force (PyTorch switches)", summarise(times))

    # 2. fused_attention's per-call path vs calling the same backend directly. A policy
    # naming an SDPA kernel takes the short path (F.sdpa under that backend's flags, once
    # a call has resolved to it); "auto" resolves each call signature once and caches it.
    chosen = "flash_v2"  # PyTorch's FlashAttention-2 on CUDA, its C++ port on the CPU
    backend = torch.nn.attention.SDPBackend.FLASH_ATTENTION
    for strict in (True, False):
        xpt.set_kernel_policy(attention=chosen, strict=strict)
        label = f"attention 1x2x16x64, policy {chosen}{' strict' if strict else ''}"
        with torch.nn.attention.sdpa_kernel(backend):
            row(
                f"{label}: F.sdpa vs ops.fused_attention",
                lambda: F.scaled_dot_product_attention(q, q, q),
                lambda: xpt.ops.fused_attention(q, q, q),
            )
            row(
                f"{label}, causal",
                lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                lambda: xpt.ops.fused_attention(q, q, q, is_causal=True),
            )
    # Outside an sdpa_kernel block, the non-strict policy's flags (the kernel, then math)
    # are switched to the kernel alone around each call and back.
    row(
        f"attention 1x2x16x64, policy {chosen}, PyTorch's flags as the policy left them",
        lambda: F.scaled_dot_product_attention(q, q, q),
        lambda: xpt.ops.fused_attention(q, q, q),
    )
    xpt.set_kernel_policy(attention="auto")
    with torch.nn.attention.sdpa_kernel(backend):
        row(
            f"attention 1x2x16x64, policy auto (picks {chosen}): per-signature path",
            lambda: F.scaled_dot_product_attention(q, q, q),
            lambda: xpt.ops.fused_attention(q, q, q),
        )
    xpt.clear_kernel_policy()

    # 3. Dispatch logging: off vs on (a TorchDispatchMode sees every op).
    samples = {"anchor": [], "ours": []}
    for _ in range(15):
        samples["anchor"].append(per_call(lambda: a @ a, args.calls // 4, device))
        xpt.enable_dispatch_logging()
        samples["ours"].append(per_call(lambda: a @ a, args.calls // 4, device))
        xpt.disable_dispatch_logging()
        xpt.clear_dispatch_logs()
    report("mm 64x64, dispatch logging off vs on", summarise(samples))

    if device.type == "cuda" or _interpreting():
        host_cost_table(device, dtype, args.calls // 4)
    if device.type == "cuda":
        first_call_table(device, dtype)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def host_cost_table(device, dtype, calls) -> None:
    """Host cost per call of each routed op against the PyTorch op it replaces, at a tiny
    shape (8 x 768: the kernels take a few µs, so the host decides), forward under
    no_grad and forward+backward. Goal: at most 1.5x PyTorch's."""
    from torch import nn

    from xpuruntime.pytorch._functional._linear import linear_gelu
    from xpuruntime.pytorch._functional._residual import residual_layer_norm

    d = 768
    x = torch.randn(8, d, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(8, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(8, d, device=device, dtype=dtype)
    ln = nn.LayerNorm(d, device=device, dtype=dtype)
    rms = nn.RMSNorm(d, device=device, dtype=dtype)
    fc = nn.Linear(d, d, device=device, dtype=dtype)
    fused_ln = xpt.ops.FusedLayerNorm.from_layernorm(ln)
    fused_rms = xpt.ops.FusedRMSNorm.from_module(rms)
    fused_fc = xpt.ops.FusedLinear.from_linear(fc)
    xpt.set_kernel_policy(
        layernorm="fused", rmsnorm="fused", residual_layernorm="fused", linear="fused",
        linear_gelu="fused",
    )  # fmt: skip
    ops = {
        "layernorm (F.layer_norm vs fused)": (lambda t: ln(t), lambda t: fused_ln(t)),
        "rmsnorm (F.rms_norm vs fused)": (lambda t: rms(t), lambda t: fused_rms(t)),
        "residual_layernorm (add + F.layer_norm vs fused)": (
            lambda t: ln(t + r),
            lambda t: residual_layer_norm(t, r, ln)[1],
        ),
        "public ops.fused_layernorm (vs F.layer_norm)": (
            lambda t: F.layer_norm(t, (d,), ln.weight, ln.bias),
            lambda t: xpt.ops.fused_layernorm(t, (d,), ln.weight, ln.bias),
        ),
        "public ops.fused_rmsnorm (vs F.rms_norm)": (
            lambda t: F.rms_norm(t, (d,), rms.weight, 1e-6),
            lambda t: xpt.ops.fused_rmsnorm(t, (d,), rms.weight, 1e-6),
        ),
        "linear (F.linear vs fused)": (lambda t: fc(t), lambda t: fused_fc(t)),
        "linear_gelu (F.linear + F.gelu vs fused)": (
            lambda t: F.gelu(fc(t), approximate="tanh"),
            lambda t: linear_gelu(t, fc, "tanh"),
        ),
    }
    print("\n# host cost per call, 8 x 768, µs (fastest window of 15)")
    print("| op | PyTorch fwd | ours fwd | ratio | PyTorch fwd+bwd | ours fwd+bwd | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, (anchor, ours) in ops.items():
        with torch.no_grad():
            fwd = interleaved({"a": lambda f=anchor: f(x), "o": lambda f=ours: f(x)}, calls, device)

        def step(fn):
            return lambda: fn(x).backward(g)

        both = interleaved({"a": step(anchor), "o": step(ours)}, calls, device)
        (fa, _), (fo, _) = fwd["a"], fwd["o"]
        (ba, _), (bo, _) = both["a"], both["o"]
        print(
            f"| {label} | {fa * 1e6:.1f} | {fo * 1e6:.1f} | {fo / fa:.2f}x "
            f"| {ba * 1e6:.1f} | {bo * 1e6:.1f} | {bo / ba:.2f}x |"
        )
    xpt.clear_kernel_policy()


def first_call_table(device, dtype, shapes=20) -> None:
    """Host time of the first and the second forward+backward of each new call signature
    through the public ops (the first runs the Python launches; the second derives the
    signature's launch plan, then runs it) against the same op's Python launches (which
    keep nothing per signature), on fresh row counts of one specialisation class, the
    kernels compiled before. Goal: the first call at most 1.5x, with no device sync (the
    GPU is synchronised between calls, outside the timing)."""
    from xpuruntime.pytorch._ops.fused_add_layernorm import run_add_layernorm
    from xpuruntime.pytorch._ops.fused_layernorm import run_layernorm
    from xpuruntime.pytorch._ops.fused_rmsnorm import run_rmsnorm

    d = 768
    w = torch.randn(d, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(d, device=device, dtype=dtype, requires_grad=True)
    ops = {
        "fused_layernorm": (
            lambda x, r: xpt.ops.fused_layernorm(x, (d,), w, b),
            lambda x, r: run_layernorm(x, d, w, b, 1e-5, dtype),
        ),
        "fused_rmsnorm": (
            lambda x, r: xpt.ops.fused_rmsnorm(x, (d,), w, 1e-6),
            lambda x, r: run_rmsnorm(x, d, w, 1e-6, dtype),
        ),
        "fused_add_layernorm": (
            lambda x, r: xpt.ops.fused_add_layernorm(x, r, (d,), w, b)[1],
            lambda x, r: run_add_layernorm(x, r, d, w, b, 1e-5, dtype)[1],
        ),
    }
    print(f"\n# first calls of a new signature, fwd+bwd, {shapes} shapes (rows 32k / 32k+16) x {d}")
    print(
        "| op | Python launches µs | first call µs | ratio | second call (derives its plan) µs | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, (ours, python) in ops.items():
        for fn in (ours, python):  # compile the kernels of this specialisation class
            first(fn, 16, d, device, dtype)
            first(fn, 16, d, device, dtype)
        times = {"first": [], "second": [], "python": []}
        for k in range(1, shapes + 1):
            once, twice = first(ours, 32 * k + 64, d, device, dtype, calls=2)
            times["first"].append(once)
            times["second"].append(twice)
            times["python"].append(first(python, 32 * k + 80, d, device, dtype))
        o, s, p = (statistics.median(times[k]) for k in ("first", "second", "python"))
        print(
            f"| {label} | {p * 1e6:.0f} | {o * 1e6:.0f} | {o / p:.2f}x | {s * 1e6:.0f} | {s / p:.2f}x |"
        )


def first(fn, rows, d, device, dtype, calls=1):
    """Host seconds of one forward+backward of ``fn`` on fresh (rows, d) inputs (with
    ``calls`` > 1: of each of that many calls on them, in order)."""
    x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, d, device=device, dtype=dtype)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x, r).backward(g)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return times[0] if calls == 1 else times


if __name__ == "__main__":
    main()

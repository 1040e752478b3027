"""Host time per call of the GEMMs a LoRA layer issues, at Gemma3-1B's shapes (B4 x T2048).

A plain training loop is host-bound where its host work per step exceeds its kernels'
time (Gemma3-1B's LoRA step: 95 ms of kernels, 140-170 ms of host time). This measures
what each GEMM form costs the host, three ways:

- on the calling thread (a forward);
- in a backward run by autograd's device thread (PyTorch's default for CUDA tensors);
- in a backward on the calling thread (``torch.autograd.set_multithreading_enabled(False)``);

each under cuBLAS and cuBLASLt as PyTorch's preferred BLAS library. Few enough calls that
the launch queue never fills, so what is timed is the host's work, not the GPU's.

    python benchmarks/bench_launch_cost.py [--calls 64] [--rounds 15]
"""

import argparse
import statistics
import time

import torch

ROWS, WIDTH, OUT, RANK = 8192, 1152, 1536, 48  # tokens, hidden, q+k+v, three adapters' r


def forms(device):
    """The GEMM forms of the LoRA op's forward and backward: name -> a call."""
    bf16 = torch.bfloat16
    x = torch.randn(ROWS, WIDTH, device=device, dtype=bf16)
    w = torch.randn(OUT, WIDTH, device=device, dtype=bf16)
    a = torch.randn(RANK, WIDTH, device=device, dtype=bf16)
    diag = torch.randn(OUT, RANK, device=device, dtype=bf16)
    dy = torch.randn(ROWS, OUT, device=device, dtype=bf16)
    t = torch.randn(ROWS, RANK, device=device, dtype=bf16)
    ds = torch.randn(ROWS, RANK, device=device, dtype=bf16)
    joined = torch.empty(ROWS, OUT, device=device, dtype=bf16)
    unread = x.new_empty(())
    return {
        "mm x A^T": lambda: x @ a.t(),
        "addmm beta 0, alpha 2": lambda: torch.addmm(unread, x, a.t(), beta=0, alpha=2.0),
        "linear x W^T": lambda: torch.nn.functional.linear(x, w),
        "addmm_ in place (t diag^T)": lambda: joined.addmm_(t, diag.t()),
        "mm ds A then addmm_ dY W": lambda: torch.mm(ds, a).addmm_(dy, w),
        "mm out_dtype fp32 (dB)": lambda: torch.mm(dy.t()[:512], t, out_dtype=torch.float32),
        "empty_like (no kernel)": lambda: torch.empty_like(x),
    }


class _Calls(torch.autograd.Function):
    """A node whose backward makes ``calls`` calls of ``fn``, timing them on whatever
    thread autograd runs it."""

    @staticmethod
    def forward(ctx, x, fn, calls, seconds):
        ctx.fn, ctx.calls, ctx.seconds = fn, calls, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        t0 = time.perf_counter()
        for _ in range(ctx.calls):
            ctx.fn()
        ctx.seconds.append(time.perf_counter() - t0)
        return dy, None, None, None


def host_us(fn, calls, where, device):
    """Microseconds of host time per call of ``fn`` made ``where``."""
    torch.cuda.synchronize(device)
    if where == "forward":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds = time.perf_counter() - t0
    else:
        x = torch.zeros(8, device=device, requires_grad=True)
        timed = []
        out = _Calls.apply(x * 1, fn, calls, timed)
        with torch.autograd.set_multithreading_enabled(where == "device thread"):
            out.sum().backward()
        seconds = timed[0]
    torch.cuda.synchronize(device)
    return seconds / calls * 1e6


class _Pass(torch.autograd.Function):
    """A Python node that does nothing in its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def node_us(nodes, threaded, device):
    """Microseconds of host time per Python autograd node in a chain of ``nodes``."""
    x = torch.zeros(8, device=device, requires_grad=True)
    out = x * 1
    for _ in range(nodes):
        out = _Pass.apply(out)
    loss = out.sum()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.autograd.set_multithreading_enabled(threaded):
        loss.backward()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return seconds / nodes * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call,"
        f" median (min) of {args.rounds} windows of {args.calls} calls"
    )
    calls = forms(device)
    wheres = ("forward", "backward, device thread", "backward, calling thread")
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        print(f"\n## preferred BLAS library: {library}")
        print("| call | " + " | ".join(wheres) + " |")
        print("| --- |" + " ---: |" * len(wheres))
        for name, fn in calls.items():
            cells = []
            for where in wheres:
                where = where.split(", ")[-1]
                host_us(fn, 8, where, device)  # (warm: heuristics, the thread, the pool)
                times = [host_us(fn, args.calls, where, device) for _ in range(args.rounds)]
                cells.append(f"{statistics.median(times):.1f} ({min(times):.1f})")
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n## a Python autograd node whose backward does nothing, µs per node (200 a chain)")
    for threaded in (True, False):
        node_us(200, threaded, device)
        times = [node_us(200, threaded, device) for _ in range(args.rounds)]
        where = "device thread" if threaded else "calling thread"
        print(f"- {where}: {statistics.median(times):.1f} ({min(times):.1f})")


if __name__ == "__main__":
    main()

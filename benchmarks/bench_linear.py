"""Linear layers under bf16 autocast, fp32 parameters: PyTorch against ops.fused_linear and
ops.fused_linear_gelu, in one run (GPU).

fwd+bwd ms (input, weight and bias gradients), replayed from a CUDA graph so that the
host's launch time does not count:

- ``linear + gelu``: ``F.gelu(F.linear(x, w, b), approximate="tanh")`` as autocast runs
  it (the anchor; a transformer MLP's first layer);
- ``fused_linear + gelu``: our fused_linear (parameter gradients written in fp32 by the
  GEMM and a column-sum kernel), then F.gelu;
- ``fused_linear_gelu``: GELU's backward and the bias gradient in one pass, then the
  GEMMs;
- ``cublaslt``: the same backward; forward, one cuBLASLt GEMM whose GELU_AUX_BIAS
  epilogue writes GELU's input and output (needs nvmath-python; the column is left out
  without it).

The forward alone too: ``F.linear`` then ``F.gelu`` against the epilogue. And a whole
MLP (linear, GELU, linear back to the input width), fwd+bwd: PyTorch's layers; our
fused_linear_gelu with the cuBLASLt forward then fused_linear; ``ops.fused_mlp``, whose
second layer's input-gradient GEMM applies GELU's derivative in its epilogue.

Then the pass itself: GELU's backward and the bias gradient, PyTorch's ``gelu_backward``
followed by ``sum(0)`` in fp32 against our one kernel, with the bytes each moves.

    python benchmarks/bench_linear.py
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from xpuruntime.pytorch._ops._infra import _cublaslt
from xpuruntime.pytorch._ops.fused_linear import gelu_backward
from xpuruntime.pytorch.ops import fused_linear, fused_linear_gelu, fused_mlp

SHAPES = [(16384, 768, 3072), (16384, 1024, 4096), (16384, 2048, 8192)]


def layer_ms(m: int, k: int, n: int) -> dict[str, float]:
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    w = (torch.randn(n, k, device="cuda") / k**0.5).requires_grad_()
    b = torch.zeros(n, device="cuda", requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    impls = {
        "torch": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "fused_linear": lambda: F.gelu(fused_linear(x, w, b), approximate="tanh"),
        "fused_linear_gelu": lambda: fused_linear_gelu(x, w, b, approximate="tanh"),
    }
    if _cublaslt.unavailable() is None:
        impls["cublaslt"] = lambda: fused_linear_gelu(x, w, b, "tanh", forward="cublaslt")

    def step(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        return torch.autograd.grad(out, (x, w, b), g)

    return {
        name: do_bench_cudagraph(lambda fn=fn: step(fn), return_mode="median")
        for name, fn in impls.items()
    }


def forward_ms(m: int, k: int, n: int) -> dict[str, float]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return {
        "torch": do_bench_cudagraph(
            lambda: F.gelu(F.linear(x, w, b), approximate="tanh"), return_mode="median"
        ),
        "cublaslt": do_bench_cudagraph(
            lambda: _cublaslt.gelu_aux_linear(x, w, b), return_mode="median"
        ),
    }


def mlp_ms(m: int, k: int, n: int) -> dict[str, float]:
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    w1 = (torch.randn(n, k, device="cuda") / k**0.5).requires_grad_()
    b1 = torch.zeros(n, device="cuda", requires_grad=True)
    w2 = (torch.randn(k, n, device="cuda") / n**0.5).requires_grad_()
    b2 = torch.zeros(k, device="cuda", requires_grad=True)
    g = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    impls = {
        "torch": lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2),
        "layers": lambda: fused_linear(
            fused_linear_gelu(x, w1, b1, "tanh", forward="cublaslt"), w2, b2
        ),
        "fused_mlp": lambda: fused_mlp(x, w1, b1, w2, b2),
    }

    def step(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        return torch.autograd.grad(out, (x, w1, b1, w2, b2), g)

    return {
        name: do_bench_cudagraph(lambda fn=fn: step(fn), return_mode="median")
        for name, fn in impls.items()
    }


def pass_ms(m: int, n: int) -> dict[str, float]:
    pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn_like(pre)

    def torch_pass():
        d = torch.ops.aten.gelu_backward(dh, pre, approximate="tanh")
        return d, d.sum(0, dtype=torch.float32)

    return {
        "torch": do_bench_cudagraph(torch_pass, return_mode="median"),
        "ours": do_bench_cudagraph(
            lambda: gelu_backward(dh, pre, "tanh", torch.float32), return_mode="median"
        ),
    }


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 autocast")
    print("\n## linear + GELU (tanh), fwd+bwd ms (speed-up vs linear + gelu)")
    epilogue = _cublaslt.unavailable() is None
    print(
        "| rows x in -> out | linear + gelu | fused_linear + gelu | fused_linear_gelu |"
        + (" cublaslt |" if epilogue else "")
    )
    print("| --- | --- | --- | --- |" + (" --- |" if epilogue else ""))
    for m, k, n in SHAPES:
        ms = layer_ms(m, k, n)
        cells = [f"{ms[i]:.3f} ({ms['torch'] / ms[i]:.2f}x)" for i in ms]
        print(f"| {m} x {k} -> {n} | " + " | ".join(cells) + " |", flush=True)
    if epilogue:
        print("\n## forward alone, ms: F.linear + F.gelu against cuBLASLt's GELU_AUX_BIAS")
        print("| rows x in -> out | linear + gelu | epilogue | speed-up |")
        print("| --- | --- | --- | --- |")
        for m, k, n in SHAPES:
            ms = forward_ms(m, k, n)
            print(
                f"| {m} x {k} -> {n} | {ms['torch']:.3f} | {ms['cublaslt']:.3f} "
                f"| {ms['torch'] / ms['cublaslt']:.2f}x |",
                flush=True,
            )
        print("\n## MLP (linear, GELU, linear), fwd+bwd ms (speed-up vs PyTorch's layers)")
        print("| rows x in -> hidden -> in | PyTorch | cublaslt linear_gelu + fused_linear "
              "| fused_mlp |")  # fmt: skip
        print("| --- | --- | --- | --- |")
        for m, k, n in SHAPES:
            ms = mlp_ms(m, k, n)
            cells = [f"{ms[i]:.3f} ({ms['torch'] / ms[i]:.2f}x)" for i in ms]
            print(f"| {m} x {k} -> {n} -> {k} | " + " | ".join(cells) + " |", flush=True)
    else:
        print(f"(cuBLASLt's GELU epilogue {_cublaslt.unavailable()}: not measured)")
    print("\n## GELU backward + bias gradient, ms (bf16 in and out; GB/s over the bytes moved)")
    print("| rows x cols | gelu_backward + sum(0) | ours, one pass | speed-up |")
    print("| --- | --- | --- | --- |")
    for m, _, n in SHAPES:
        ms = pass_ms(m, n)
        # PyTorch: reads dh and pre, writes d, reads d again; ours: reads dh and pre, writes d.
        unfused, fused = 4 * m * n * 2, 3 * m * n * 2
        print(
            f"| {m} x {n} | {ms['torch']:.3f} ({unfused / ms['torch'] / 1e6:.0f} GB/s) "
            f"| {ms['ours']:.3f} ({fused / ms['ours'] / 1e6:.0f} GB/s) "
            f"| {ms['torch'] / ms['ours']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()

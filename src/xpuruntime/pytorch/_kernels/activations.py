"""The ``swiglu`` and ``geglu`` kernels: PyTorch's expressions and our Triton passes
(:mod:`.._ops.swiglu`)."""

from __future__ import annotations

from typing import Any

from ...kernels import Support
from ._base import RunsAnything, TritonKernel
from ._context import ActivationContext

__all__ = ["FusedGeGLUKernel", "FusedSwiGLUKernel", "TorchGeGLU", "TorchSwiGLU"]


class TorchSwiGLU(RunsAnything):
    op = "swiglu"
    name = "torch"
    summary = "F.silu(gate) * up (keeps silu(gate) for the backward)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        from .._ops.swiglu import torch_swiglu

        return torch_swiglu


class FusedSwiGLUKernel(TritonKernel):
    op = "swiglu"
    name = "fused"
    summary = "xpuruntime's Triton swiglu (one pass each way, sigmoid recomputed)"

    def _supports_triton(self, ctx: ActivationContext) -> Support:
        return Support.yes("our Triton SwiGLU kernels (fp32 math, keeps only gate and up)")

    def runner(self) -> Any:
        from .._ops.swiglu import run_swiglu

        return run_swiglu


class TorchGeGLU(RunsAnything):
    op = "geglu"
    name = "torch"
    summary = "F.gelu(gate, approximate='tanh') * up (keeps gelu(gate) for the backward)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        from .._ops.swiglu import torch_geglu

        return torch_geglu


class FusedGeGLUKernel(TritonKernel):
    op = "geglu"
    name = "fused"
    summary = "xpuruntime's Triton geglu (one pass each way, GELU recomputed)"

    def _supports_triton(self, ctx: ActivationContext) -> Support:
        return Support.yes("our Triton GeGLU kernels (fp32 math, keeps only gate and up)")

    def runner(self) -> Any:
        from .._ops.swiglu import run_geglu

        return run_geglu

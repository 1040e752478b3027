"""The ``swiglu`` and ``geglu`` kernels: PyTorch's expressions and our Triton passes
(:mod:`.._ops.swiglu`), and those passes keeping gate and up in FP8 for the backward
(the policy's ``fp8_activations``; named ``fp8``, which either FP8 precision puts first
in ``auto``'s order)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...kernels import Support
from ._base import RunsAnything, TritonKernel
from ._context import ActivationContext

__all__ = [
    "Fp8KeptGeGLU",
    "Fp8KeptSwiGLU",
    "FusedGeGLUKernel",
    "FusedSwiGLUKernel",
    "TorchGeGLU",
    "TorchSwiGLU",
]


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


class _Fp8Kept(TritonKernel):
    """The fused passes, gate and up kept for the backward in FP8
    (:func:`.._ops.swiglu.run_fp8_kept`). They run under the policy's
    ``fp8_activations``, on an FP8 GPU, where a backward will read what is kept."""

    activation: str

    def _supports_triton(self, ctx: ActivationContext) -> Support:
        from .fp8 import fp8_refusal

        if not ctx.fp8_kept:
            return Support.no("the policy's fp8_activations is off: gate and up kept as they are")
        why = fp8_refusal(ctx.device)
        if why is not None:
            return Support.unavailable(why.replace("FP8 GEMMs", "FP8 activations"))
        if ctx.dtype not in (torch.bfloat16, torch.float16):
            return Support.no(f"FP8 activations are kept for bf16 or fp16 ones, not {ctx.dtype}")
        if not ctx.requires_grad:
            return Support.no("no backward: nothing is kept")
        return Support.yes(
            f"our Triton {self.activation} kernels, gate and up kept in FP8 (e4m3, a scale "
            f"per row) for the backward (fp8_activations)"
        )

    def runner(self) -> Any:
        from .._ops.swiglu import run_fp8_kept

        return functools.partial(run_fp8_kept, self.activation)


_KEPT = "xpuruntime's Triton {} (one pass each way), gate and up kept in FP8 (e4m3, a scale per row) for the backward"  # fmt: skip


class Fp8KeptSwiGLU(_Fp8Kept):
    op = "swiglu"
    name = "fp8"
    summary = _KEPT.format("swiglu")
    activation = "swiglu"


class Fp8KeptGeGLU(_Fp8Kept):
    op = "geglu"
    name = "fp8"
    summary = _KEPT.format("geglu")
    activation = "geglu"

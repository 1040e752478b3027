"""The ``conv`` kernels: cuDNN's settings for PyTorch's convolutions (process-wide
switches, set when the policy is)."""

from __future__ import annotations

import torch

from ...kernels import Support
from ._base import RunsAnything, TorchKernel, cudnn_missing

__all__ = ["CudnnBenchmark", "CudnnDeterministic", "DefaultConv"]


class _Cudnn(TorchKernel):
    op = "conv"

    def supports(self, ctx) -> Support:
        missing = cudnn_missing()
        if missing is not None:
            return Support.unavailable(missing)
        if ctx.device.type != "cuda":
            return Support.no(f"{self.name} is a cuDNN setting; this is {ctx.device}")
        return self._supports_cudnn(ctx)

    def _supports_cudnn(self, ctx) -> Support:
        return Support.yes(f"cuDNN {torch.backends.cudnn.version()}")


class DefaultConv(RunsAnything):
    op = "conv"
    name = "default"
    summary = "PyTorch's default convolution routing (cuDNN heuristics on CUDA)"
    why = "PyTorch's own routing runs anywhere"


class CudnnBenchmark(_Cudnn):
    name = "cudnn_benchmark"
    summary = "cuDNN autotuning: each new shape times the algorithms and keeps the fastest"

    def _supports_cudnn(self, ctx) -> Support:
        if ctx.deterministic:
            return Support.no(
                "autotuning may pick a non-deterministic algorithm and the policy asks "
                "for deterministic kernels"
            )
        return super()._supports_cudnn(ctx)


class CudnnDeterministic(_Cudnn):
    name = "cudnn_deterministic"
    summary = "cuDNN restricted to deterministic algorithms, no autotuning"

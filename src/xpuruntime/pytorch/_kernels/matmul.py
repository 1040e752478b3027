"""The ``matmul`` kernels: which BLAS library PyTorch's GEMMs go to (a process-wide
switch, set when the policy is)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ...kernels import Support
from ._base import RunsAnything, TorchKernel

__all__ = ["Cublas", "CublasLt", "DefaultMatmul"]


class _CudaBlas(TorchKernel):
    op = "matmul"
    library: ClassVar[str]

    def supports(self, ctx) -> Support:
        if torch.version.cuda is None:
            return Support.unavailable(
                f"this PyTorch build ({torch.__version__}) has no CUDA, so no {self.name}; "
                "install a CUDA build of torch"
            )
        if ctx.device.type != "cuda":
            return Support.no(f"{self.name} runs on CUDA devices; this is {ctx.device}")
        try:
            current = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(self.library)
            torch.backends.cuda.preferred_blas_library(current)
        except RuntimeError as e:
            return Support.unavailable(f"PyTorch cannot select {self.name}: {e}")
        return Support.yes(f"{self.name} is available in torch {torch.__version__}")


class CublasLt(_CudaBlas):
    name = "cublasLt"
    library = "cublaslt"
    summary = "mm/bmm/baddbmm/addmm without a fused bias through cuBLASLt"


class Cublas(_CudaBlas):
    name = "cublas"
    library = "cublas"
    summary = "mm/bmm/baddbmm/addmm without a fused bias through cuBLAS"


class DefaultMatmul(RunsAnything):
    op = "matmul"
    name = "default"
    summary = "PyTorch's startup routing (cuBLAS on CUDA, the CPU BLAS on the CPU)"
    why = "PyTorch's own routing runs anywhere"

"""The ``rmsnorm_rope`` kernels: the per-head q/k norms then the rotary embedding, as
PyTorch's expressions or in one Triton pass per tensor each way (:mod:`.._ops.norm_rope`)."""

from __future__ import annotations

from typing import Any

from ...kernels import Support
from ._base import RunsAnything, TritonKernel
from ._context import RopeContext

__all__ = ["FusedRmsNormRopeKernel", "TorchRmsNormRope"]


class TorchRmsNormRope(RunsAnything):
    op = "rmsnorm_rope"
    name = "torch"
    summary = "F.rms_norm of q and of k, then q * cos + rotate(q) * sin and the same for k"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        from .._ops.norm_rope import torch_rmsnorm_rope

        return torch_rmsnorm_rope


class FusedRmsNormRopeKernel(TritonKernel):
    op = "rmsnorm_rope"
    name = "fused"
    summary = "xpuruntime's Triton norm and rope (one pass per tensor each way)"

    def _supports_triton(self, ctx: RopeContext) -> Support:
        return Support.yes("our Triton per-head RMSNorm and rotary-embedding kernels")

    def runner(self) -> Any:
        from .._ops.norm_rope import run_rmsnorm_rope

        return run_rmsnorm_rope

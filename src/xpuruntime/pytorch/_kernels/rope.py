"""The ``rope`` kernels: PyTorch's expression and our Triton pass (:mod:`.._ops.rope`)."""

from __future__ import annotations

from typing import Any

from ...kernels import Support
from ._base import RunsAnything, TritonKernel
from ._context import RopeContext

__all__ = ["FusedRopeKernel", "TorchRope"]


class TorchRope(RunsAnything):
    op = "rope"
    name = "torch"
    summary = "q * cos + rotate(q) * sin and the same for k (six kernels each way per tensor)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        from .._ops.rope import torch_rope

        return torch_rope


class FusedRopeKernel(TritonKernel):
    op = "rope"
    name = "fused"
    summary = "xpuruntime's Triton rope (one pass per tensor each way, in place of layout)"

    def _supports_triton(self, ctx: RopeContext) -> Support:
        return Support.yes("our Triton rotary-embedding kernels (fp32 math, any q/k strides)")

    def runner(self) -> Any:
        from .._ops.rope import run_rope

        return run_rope

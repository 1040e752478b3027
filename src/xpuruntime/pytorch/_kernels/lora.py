"""The ``lora_linear`` kernels: the adapter's chain as peft writes it, and ours as one
autograd node over cuBLAS GEMMs (:mod:`.._ops.lora_linear`)."""

from __future__ import annotations

from typing import Any

from ...kernels import Support
from ._base import RunsAnything, TorchKernel
from ._context import LoraContext

__all__ = ["FusedLoraLinear", "TorchLoraLinear"]


class FusedLoraLinear(TorchKernel):
    op = "lora_linear"
    name = "fused"
    summary = (
        "one node per layer or group of one input: joined base GEMM, x A^T kept, the "
        "block-diagonal s B step accumulated into it, ds = s dY B shared"
    )

    def supports(self, ctx: LoraContext) -> Support:
        if not ctx.compute_dtype.is_floating_point:
            return Support.no(f"GEMMs of floats only, not {ctx.compute_dtype}")
        if any(ctx.dropout):
            from .._ops._infra._launch import triton_unavailable
            from .._ops._infra._lora_dropout import fits

            why = triton_unavailable(ctx.device) or fits(
                ctx.rows, ctx.input.shape[-1], ctx.ranks, ctx.dropout
            )
            if why is not None:
                return Support.no(f"dropout drawn in Triton kernels: {why}")
            return Support.yes(
                "PyTorch's GEMMs in one autograd node, the dropout masks drawn and applied "
                "in Triton kernels (kept as bits)"
            )
        return Support.yes("PyTorch's GEMMs in one autograd node (any device)")

    def runner(self) -> Any:
        from .._ops.lora_linear import lora_projections

        return lora_projections


class TorchLoraLinear(RunsAnything):
    op = "lora_linear"
    name = "torch"
    summary = "base(x) + lora_B(lora_A(x)) * scaling, as peft writes it (five kernels forward)"
    why = "PyTorch's own GEMMs take any arguments"

    def runner(self) -> Any:
        from .._ops.lora_linear import torch_lora_projections

        return torch_lora_projections

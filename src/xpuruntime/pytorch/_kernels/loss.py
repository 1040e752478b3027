"""The ``cross_entropy`` kernels: a language-model head's loss, from materialised
logits (PyTorch), or chunked without them: ours (:mod:`.._ops.fused_linear_cross_entropy`)
and, where PyTorch has it (torch >= 2.13), ``F.linear_cross_entropy``'s chunked path."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels import Support
from ._base import RunsAnything, TorchKernel, TritonKernel
from ._context import LossContext

__all__ = ["FusedLinearCrossEntropyKernel", "TorchChunkedCrossEntropy", "TorchCrossEntropy"]


class TorchCrossEntropy(RunsAnything):
    op = "cross_entropy"
    name = "torch"
    summary = "F.linear then F.cross_entropy (the logits materialised)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        """None for the loss: the logits are materialised and the model's own
        ``F.cross_entropy`` call runs on them, with its exact arguments."""
        return lambda logits, target, ignore_index, reduction, unsupported: None

    def timed(self, runner: Any) -> Any:
        return self.run  # the loss the model's own call computes

    def run(self, logits, target, ignore_index, reduction, unsupported=()) -> torch.Tensor:
        """The loss from the materialised logits (what a timing run measures)."""
        loss = torch.nn.functional.cross_entropy
        return loss(logits.materialize(), target, ignore_index=ignore_index, reduction=reduction)


class FusedLinearCrossEntropyKernel(TritonKernel):
    op = "cross_entropy"
    name = "fused_linear"
    summary = "xpuruntime's chunked head + cross-entropy (no logits materialised)"
    _takes = "the fused loss takes"

    def _supports_triton(self, ctx: LossContext) -> Support:
        if ctx.reduction not in ("mean", "sum"):
            return Support.no(
                f"reduction={ctx.reduction!r}: the fused loss forms its gradients in the "
                "forward, which needs 'mean' or 'sum'"
            )
        if ctx.unsupported_arguments:
            return Support.no(f"not fused: {', '.join(ctx.unsupported_arguments)}")
        return Support.yes("chunked GEMMs and our Triton softmax/gradient kernel")

    def runner(self) -> Any:
        from .._ops.fused_linear_cross_entropy import fused_linear_cross_entropy

        def run(logits, target, ignore_index, reduction, unsupported):
            # The GEMM in the head's dtype, whatever the logits were cast to before the
            # loss (Hugging Face's logits.float()): the fused loss computes in fp32.
            hidden, dtype, bias = logits._hidden, logits._compute, logits._bias
            scale, softcap = logits.transform
            with torch._C.DisableTorchFunctionSubclass():
                return fused_linear_cross_entropy(
                    hidden.to(dtype), logits._weight.to(dtype),
                    target.reshape(hidden.shape[:-1]), None if bias is None else bias.to(dtype),
                    ignore_index=ignore_index, reduction=reduction, scale=scale,
                    softcap=softcap,
                )  # fmt: skip

        return run


class TorchChunkedCrossEntropy(TorchKernel):
    op = "cross_entropy"
    name = "torch_chunked"
    summary = (
        "PyTorch's F.linear_cross_entropy, chunked (no logits materialised; torch >= 2.13; "
        "a bf16 head's GEMMs in fp32, for an fp32 loss)"
    )

    def supports(self, ctx: LossContext) -> Support:
        if not hasattr(torch.nn.functional, "linear_cross_entropy"):
            return Support.no(
                f"torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13)"
            )
        if ctx.reduction not in ("mean", "sum"):
            return Support.no(f"reduction={ctx.reduction!r}: only 'mean' and 'sum' are routed here")
        if ctx.unsupported_arguments:
            return Support.no(f"not fused: {', '.join(ctx.unsupported_arguments)}")
        if ctx.softcap is not None:
            return Support.no("the logits are soft-capped, which F.linear_cross_entropy cannot do")
        return Support.yes("F.linear_cross_entropy with LinearCrossEntropyOptions (chunked)")

    def runner(self) -> Any:
        def run(logits, target, ignore_index, reduction, unsupported):
            # The softmax accumulated in fp32 and an fp32 loss (what the model's
            # logits.float() asked for). F.linear_cross_entropy returns its input's
            # dtype, so a bf16 head runs in fp32: off CUDA it casts the operands to fp32
            # itself anyway; on CUDA its GEMMs then run in fp32 (fp16 keeps its GEMMs,
            # its loss comes back in fp32). A scale of the logits is one of the hidden
            # states (and of the bias).
            hidden, bias = logits._hidden, logits._bias
            dtype = torch.float32 if logits._compute == torch.bfloat16 else logits._compute
            scale = logits.transform[0]
            options = torch.nn.LinearCrossEntropyOptions(
                acc_dtype=torch.float32 if dtype == torch.float16 else None
            )
            with torch._C.DisableTorchFunctionSubclass():
                hidden = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
                if bias is not None:
                    bias = bias.to(dtype) if scale == 1.0 else bias.to(dtype) * scale
                loss = torch.nn.functional.linear_cross_entropy(
                    hidden if scale == 1.0 else hidden * scale, logits._weight.to(dtype),
                    target.reshape(-1), linear_bias=bias,
                    reduction=reduction, ignore_index=ignore_index, options=options,
                )  # fmt: skip
            return loss.float()

        return run

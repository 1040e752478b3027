"""The ``layernorm``, ``rmsnorm``, ``residual_layernorm`` and ``residual_rmsnorm``
kernels: PyTorch's norms and our Triton ones (:mod:`.._ops.fused_layernorm`,
:mod:`.._ops.fused_rmsnorm`, :mod:`.._ops.fused_add_layernorm`,
:mod:`.._ops.fused_add_rmsnorm`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...kernels import Support, dispatcher
from .._ops._infra._frozen_casts import frozen_scale
from ._base import RunsAnything, TritonKernel, replayable
from ._context import NormContext, ResidualNormContext

__all__ = [
    "FusedLayerNormKernel",
    "FusedRMSNormKernel",
    "FusedResidualLayerNormKernel",
    "FusedResidualRMSNormKernel",
    "TorchLayerNorm",
    "TorchRMSNorm",
    "TorchResidualLayerNorm",
    "TorchResidualRMSNorm",
]


class _TorchNorm(RunsAnything):
    name = "torch"
    why = "PyTorch's own kernel runs any inputs"


class TorchLayerNorm(_TorchNorm):
    op = "layernorm"
    summary = "F.layer_norm (PyTorch's native_layer_norm kernels)"

    def runner(self) -> Any:
        layer_norm = torch.nn.functional.layer_norm

        def run(input, normalized_shape, weight, bias, eps, out_dtype):
            y = layer_norm(input, normalized_shape, weight, bias, eps)
            return y if out_dtype is None else y.to(out_dtype)

        return run


class TorchRMSNorm(_TorchNorm):
    op = "rmsnorm"
    summary = "F.rms_norm (PyTorch's kernel, or its composite of elementwise ops)"

    def runner(self) -> Any:
        rms_norm = torch.nn.functional.rms_norm

        def run(input, normalized_shape, weight, eps, out_dtype):
            y = rms_norm(input, normalized_shape, weight, eps)
            return y if out_dtype is None else y.to(out_dtype)

        return run


class _Planned:
    """A fused kernel whose runner offers each call to the launch plan of the call
    signature first (:mod:`.._ops._infra._native`): ``_replay(ctx)`` gives the signature's
    plan (None: the launchers run), ``_plan_args(*call)`` the plan's arguments."""

    def planned(self, ctx: Any) -> Any:
        run = self.runner()
        replay = self._replay(ctx) if replayable(ctx.device) else None
        if replay is None:
            return run
        plan_args = self._plan_args

        def planned(*call):
            if not dispatcher.log.enabled:  # the dispatch log sees our registered op
                out = replay.call(*plan_args(*call))
                if out is not None:
                    return out
            return run(*call)

        return planned


class _FusedNorm(_Planned, TritonKernel):
    name = "fused"

    def _supports_triton(self, ctx: NormContext) -> Support:
        return Support.yes(f"our Triton {self.op} kernels (deterministic, fp32 accumulation)")


class FusedLayerNormKernel(_FusedNorm):
    op = "layernorm"
    summary = "xpuruntime's Triton fused_layernorm (forward and backward)"

    def runner(self) -> Any:
        from .._ops.fused_layernorm import run_layernorm

        def run(input, normalized_shape, weight, bias, eps, out_dtype):
            n = math.prod(normalized_shape)
            return run_layernorm(input, n, weight, bias, eps, out_dtype or input.dtype)

        return run

    def _replay(self, ctx: NormContext) -> Any:
        from .._ops.fused_layernorm import replay_layernorm

        return replay_layernorm(math.prod(ctx.normalized_shape))

    @staticmethod
    def _plan_args(input, normalized_shape, weight, bias, eps, out_dtype) -> tuple:
        return input, weight, bias, None, eps, out_dtype or input.dtype


class FusedRMSNormKernel(_FusedNorm):
    """Its output is marked as made again from its input (:func:`mark_normed`)."""

    op = "rmsnorm"
    summary = "xpuruntime's Triton fused_rmsnorm (forward and backward)"

    def planned(self, ctx: NormContext) -> Any:
        from .._ops import fused_rmsnorm

        run = super().planned(ctx)

        def marked(input, normalized_shape, weight, eps, out_dtype):
            out = run(input, normalized_shape, weight, eps, out_dtype)
            fused_rmsnorm.mark_normed(out, input, normalized_shape, weight, eps, out_dtype)
            return out

        return marked

    def runner(self) -> Any:
        from .._ops.fused_rmsnorm import run_rmsnorm

        def run(input, normalized_shape, weight, eps, out_dtype):
            n = math.prod(normalized_shape)
            eps = torch.finfo(input.dtype).eps if eps is None else eps
            return run_rmsnorm(input, n, weight, eps, out_dtype or input.dtype)

        return run

    def _replay(self, ctx: NormContext) -> Any:
        from .._ops.fused_rmsnorm import replay_rmsnorm

        # A module's calls share a layout: a q/k norm's are per-head views, planned as such.
        return replay_rmsnorm(math.prod(ctx.normalized_shape), strided=True)

    @staticmethod
    def _plan_args(input, normalized_shape, weight, eps, out_dtype) -> tuple:
        eps = torch.finfo(input.dtype).eps if eps is None else eps
        return input, weight, None, None, eps, out_dtype or input.dtype


# -- residual_layernorm / residual_rmsnorm (a residual add and the norm of its sum) -----------
class _TorchResidualNorm(RunsAnything):
    name = "torch"
    why = "PyTorch's add and the norm module take any inputs"

    def runner(self) -> Any:
        def run(input, branch, norm, out_dtype):
            h = input + branch
            return h, norm(h)

        return run


class _FusedResidualNorm(_Planned, TritonKernel):
    name = "fused"
    norm: str  # which norm, as the reason names it

    def _supports_triton(self, ctx: ResidualNormContext) -> Support:
        from .._ops._infra._launch import FLOAT_DTYPES

        if ctx.branch.dtype not in FLOAT_DTYPES:
            return Support.no(f"{self._takes} fp32, fp16 and bf16, not {ctx.branch.dtype}")
        return Support.yes(f"our Triton add + {self.norm} kernels (deterministic, fp32 math)")

    def _replay(self, ctx: ResidualNormContext) -> Any:
        from .._ops._infra._launch import MAX_ROW_BLOCK

        n = math.prod(ctx.normalized_shape)
        return None if n > MAX_ROW_BLOCK else self._replay_of(n)  # wider rows: the public op


class TorchResidualLayerNorm(_TorchResidualNorm):
    op = "residual_layernorm"
    summary = "the add, then the norm module (its kernel as the policy's layernorm op picks)"


class FusedResidualLayerNormKernel(_FusedResidualNorm):
    op = "residual_layernorm"
    norm = "layer norm"
    summary = "xpuruntime's Triton fused_add_layernorm (the add and the norm in one kernel)"

    def runner(self) -> Any:
        from .._ops._infra._launch import MAX_ROW_BLOCK
        from .._ops.fused_add_layernorm import fused_add_layernorm, run_add_layernorm

        def run(input, branch, norm, out_dtype):
            n = math.prod(norm.normalized_shape)
            if n > MAX_ROW_BLOCK:  # the public op adds, then normalises in chunks
                return fused_add_layernorm(
                    input, branch, norm.normalized_shape, norm.weight, norm.bias, norm.eps,
                    out_dtype=out_dtype,
                )  # fmt: skip
            out_dtype = out_dtype or torch.promote_types(input.dtype, branch.dtype)
            return run_add_layernorm(input, branch, n, norm.weight, norm.bias, norm.eps, out_dtype)

        return run

    @staticmethod
    def _replay_of(n: int) -> Any:
        from .._ops.fused_add_layernorm import replay_add_layernorm

        return replay_add_layernorm(n)

    @staticmethod
    def _plan_args(input, branch, norm, out_dtype) -> tuple:
        out_dtype = out_dtype or torch.promote_types(input.dtype, branch.dtype)
        return input, branch, norm.weight, norm.bias, norm.eps, out_dtype


class TorchResidualRMSNorm(_TorchResidualNorm):
    op = "residual_rmsnorm"
    summary = "the add, then the norm module (its kernel as the policy's rmsnorm op picks)"


class FusedResidualRMSNormKernel(_FusedResidualNorm):
    """Its normed output is marked as made again from the sum (:func:`mark_normed`): the
    kernel normalises the sum as stored, as the plain kernel does."""

    op = "residual_rmsnorm"
    norm = "RMS norm"
    summary = "xpuruntime's Triton fused_add_rmsnorm (the add and the norm in one kernel)"

    def planned(self, ctx: ResidualNormContext) -> Any:
        from .._ops import fused_rmsnorm

        run = super().planned(ctx)

        def marked(input, branch, norm, out_dtype):
            total, normed = out = run(input, branch, norm, out_dtype)
            fused_rmsnorm.mark_normed(normed, total, norm.normalized_shape, norm.weight,
                                      norm.eps, out_dtype, norm.weight_offset)  # fmt: skip
            return out

        return marked

    def runner(self) -> Any:
        from .._ops._infra._launch import MAX_ROW_BLOCK
        from .._ops.fused_add_rmsnorm import fused_add_rmsnorm, run_add_rmsnorm

        def run(input, branch, norm, out_dtype):
            n = math.prod(norm.normalized_shape)
            if n > MAX_ROW_BLOCK:  # the public op adds, then normalises in chunks
                weight = _rms_weight(norm)
                return fused_add_rmsnorm(
                    input, branch, norm.normalized_shape, weight, norm.eps, out_dtype=out_dtype
                )
            return run_add_rmsnorm(input, branch, n, *_rms_args(input, branch, norm, out_dtype))

        return run

    @staticmethod
    def _replay_of(n: int) -> Any:
        from .._ops.fused_add_rmsnorm import replay_add_rmsnorm

        return replay_add_rmsnorm(n)

    @staticmethod
    def _plan_args(input, branch, norm, out_dtype) -> tuple:
        weight, eps, out_dtype = _rms_args(input, branch, norm, out_dtype)
        return input, branch, weight, None, eps, out_dtype


def _rms_weight(norm: Any) -> torch.Tensor | None:
    """The scale an RMS norm multiplies by: Gemma's ``1 + weight`` in fp32 where the
    norm has a weight offset."""
    return frozen_scale(norm.weight, norm.weight_offset)


def _rms_args(input, branch, norm, out_dtype) -> tuple:
    """(weight, eps, out_dtype) of an add-and-RMS-norm call: eps None is the epsilon of
    the sum's dtype, as an output dtype None is the sum's dtype."""
    total = torch.promote_types(input.dtype, branch.dtype)
    eps = torch.finfo(total).eps if norm.eps is None else norm.eps
    return _rms_weight(norm), eps, out_dtype or total

"""The ``linear``, ``linear_gelu`` and ``mlp`` kernels: PyTorch's layers, our Triton
parameter-gradient kernels (:mod:`.._ops.fused_linear`) and cuBLASLt's GELU epilogues
(:mod:`.._ops.fused_mlp`, through nvmath-python)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from ...kernels import Support
from ._base import RunsAnything, TorchKernel, TritonKernel
from ._context import LinearContext, MLPContext

__all__ = [
    "CublasLtLinearGeluKernel",
    "CublasLtMLPKernel",
    "FusedLinearGeluKernel",
    "FusedLinearKernel",
    "FusedProjections",
    "TorchLinear",
    "TorchLinearGelu",
    "TorchMLP",
    "TorchProjections",
]


class TorchLinear(RunsAnything):
    op = "linear"
    name = "torch"
    summary = "F.linear (autocast's casts of the weight and bias gradients included)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        return torch.nn.functional.linear


class FusedLinearKernel(TritonKernel):
    op = "linear"
    name = "fused"
    summary = "F.linear forward; weight and bias gradients written in the parameters' dtype"
    _takes = "fused_linear takes"

    def _dtype(self, ctx: LinearContext) -> torch.dtype:
        return ctx.param_dtype

    def _supports_triton(self, ctx: LinearContext) -> Support:
        return Support.yes(
            "GEMM-written parameter gradients and our Triton column sums (deterministic)"
        )

    def runner(self) -> Any:
        from .._ops.fused_linear import fused_linear

        return fused_linear

    def planned(self, ctx: LinearContext) -> Any:
        # The layer's checks once per call signature (what they read is in it), then
        # straight to the layer.
        from .._ops.fused_linear import check_linear, run_linear

        return _checked_once(lambda input, weight, bias: check_linear(
            "fused_linear", input, weight, bias), run_linear)  # fmt: skip


# -- linear_gelu (a linear layer whose output only feeds a GELU) ------------------------------
class TorchLinearGelu(RunsAnything):
    op = "linear_gelu"
    name = "torch"
    summary = "the linear layer (its kernel as the policy's linear op picks), then F.gelu"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        gelu = torch.nn.functional.gelu
        return lambda input, layer, approximate: gelu(layer(input), approximate=approximate)


class FusedLinearGeluKernel(FusedLinearKernel):
    op = "linear_gelu"
    summary = "F.linear and F.gelu forward; GELU's and the bias's gradients in one pass"
    _takes = "fused_linear_gelu takes"

    def _supports_triton(self, ctx: LinearContext) -> Support:
        return Support.yes(
            "our Triton GELU-gradient + column-sum kernel and GEMM-written weight gradients"
        )

    forward: ClassVar[str] = "torch"  # how fused_linear_gelu computes the forward

    def runner(self) -> Any:
        from .._ops.fused_linear import fused_linear_gelu

        forward = self.forward

        def run(input, layer, approximate):
            return fused_linear_gelu(input, layer.weight, layer.bias, approximate, forward=forward)

        return run

    def planned(self, ctx: LinearContext) -> Any:
        if self.forward != "torch":
            return self.runner()
        from .._ops.fused_linear import check_linear, run_linear

        return _checked_once(
            lambda input, layer, approximate: check_linear(
                "fused_linear_gelu", input, layer.weight, layer.bias, approximate
            ),
            lambda input, layer, approximate: run_linear(
                input, layer.weight, layer.bias, approximate
            ),
        )


class _CublasLtEpilogues(TorchKernel):
    """Mixed into our Triton kernels built on cuBLASLt's GELU epilogues (through
    nvmath-python): the library's absence, then the kernel's own refusal."""

    name = "cublasLt"
    why: ClassVar[str]

    def _supports_triton(self, ctx: LinearContext) -> Support:
        from .._ops._infra import _cublaslt

        missing = _cublaslt.unavailable()
        if missing is not None:
            return Support.unavailable(f"cuBLASLt's GELU epilogues {missing}")
        refused = self._refusal(ctx)
        return Support.yes(self.why) if refused is None else Support.no(refused)

    @abstractmethod
    def _refusal(self, ctx: LinearContext) -> str | None:
        """Why the kernel cannot run ``ctx`` (None when it can), the library aside."""


class CublasLtLinearGeluKernel(_CublasLtEpilogues, FusedLinearGeluKernel):
    summary = (
        "one cuBLASLt GEMM with the GELU_AUX_BIAS epilogue forward (nvmath-python); "
        "backward as fused"
    )
    why = (
        "cuBLASLt writes GELU's input and output in one GEMM; our Triton GELU-gradient "
        "pass and GEMM-written weight gradients in the backward"
    )
    forward = "cublaslt"

    def _refusal(self, ctx: LinearContext) -> str | None:
        from .._ops._infra._cublaslt import refusal

        features = (ctx.input.shape[-1], ctx.out_features)
        return refusal(ctx.device, ctx.compute_dtype, *features, ctx.approximate)


def _checked_once(check: Any, run: Any) -> Any:
    """``run``, after ``check`` on the first call (a routed op's runner serves one call
    signature, and the checks read nothing beyond it)."""
    checked = False

    def first(*args: Any) -> Any:
        nonlocal checked
        if not checked:
            check(*args)
            checked = True
        return run(*args)

    return first


# -- mlp (a linear layer, GELU, and a linear layer) -------------------------------------------
class TorchMLP(RunsAnything):
    op = "mlp"
    name = "torch"
    summary = "the layers as written (the first and its GELU as the linear_gelu op picks)"
    why = "the layers as written take any inputs"

    def runner(self) -> Any:
        return lambda input, fc, proj, approximate, first: proj(first(input))


class CublasLtMLPKernel(_CublasLtEpilogues, TritonKernel):
    op = "mlp"
    summary = "GELU in one cuBLASLt GEMM's epilogue, its derivative in the next's (fused_mlp)"
    why = (
        "cuBLASLt's GELU_AUX_BIAS and DGELU epilogues, GEMM-written weight gradients and "
        "our Triton column sums"
    )
    _takes = "fused_mlp takes"

    def _refusal(self, ctx: MLPContext) -> str | None:
        from .._ops.fused_mlp import unsupported

        features = (ctx.input.shape[-1], ctx.out_features, ctx.proj_out_features)
        return unsupported(ctx.device, ctx.compute_dtype, *features, ctx.approximate)

    def runner(self) -> Any:
        from .._ops.fused_mlp import fused_mlp

        def run(input, fc, proj, approximate, first):
            return fused_mlp(input, fc.weight, fc.bias, proj.weight, proj.bias, approximate)

        return run


# -- projections (linear layers of one input) -------------------------------------------------
class TorchProjections(RunsAnything):
    op = "projections"
    name = "torch"
    summary = "each linear layer as written (autocast casts and keeps the input once per layer)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        from .._ops.projections import run_separately

        return run_separately


class FusedProjections(RunsAnything):
    op = "projections"
    name = "fused"
    summary = (
        "one GEMM over the joined weights each way (the input cast and kept once; its "
        "gradient summed inside the GEMM)"
    )
    why = "PyTorch's GEMMs on the weights joined in one copy take any float layers"

    def runner(self) -> Any:
        from .._ops.projections import run_joined

        return run_joined

"""The ``linear``, ``linear_gelu`` and ``mlp`` kernels: PyTorch's layers, our Triton
parameter-gradient kernels (:mod:`..ops.fused_linear`) and cuBLASLt's GELU epilogues
(:mod:`..ops.fused_mlp`, through nvmath-python)."""

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
    "Fp8Projections",
    "Fp8RowwiseProjections",
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
        from ..ops.fused_linear import fused_linear

        return fused_linear

    def planned(self, ctx: LinearContext) -> Any:
        # The layer's checks once per call signature (what they read is in it), then
        # straight to the layer.
        from ..ops.fused_linear import check_linear, run_linear

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
        from ..ops.fused_linear import fused_linear_gelu

        forward = self.forward

        def run(input, layer, approximate):
            return fused_linear_gelu(input, layer.weight, layer.bias, approximate, forward=forward)

        return run

    def planned(self, ctx: LinearContext) -> Any:
        if self.forward != "torch":
            return self.runner()
        from ..ops.fused_linear import check_linear, run_linear

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
        from ..ops import _cublaslt

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
        from ..ops._cublaslt import refusal

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
        from ..ops.fused_mlp import mlp_refusal

        features = (ctx.input.shape[-1], ctx.out_features, ctx.proj_out_features)
        return mlp_refusal(ctx.device, ctx.compute_dtype, *features, ctx.approximate)

    def runner(self) -> Any:
        from ..ops.fused_mlp import fused_mlp

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
        from ..ops.projections import run_separately

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
        from ..ops.projections import run_joined

        return run_joined


class Fp8Projections(TorchKernel):
    op = "projections"
    name = "fp8"
    summary = (
        "one GEMM over the joined weights each way with FP8 operands (torch._scaled_mm), "
        "one scale per tensor: input and weight e4m3, the output gradient e5m2"
    )
    recipe: ClassVar[str] = "tensorwise"

    def supports(self, ctx: LinearContext) -> Support:
        why = fp8_refusal(ctx.device)
        if why is not None:
            return Support.unavailable(why)
        if ctx.compute_dtype not in (torch.bfloat16, torch.float16):
            return Support.no(
                f"FP8 GEMMs here take a bf16 or fp16 compute dtype, not {ctx.compute_dtype}"
            )
        from ..ops.fp8 import unsupported

        why = unsupported(ctx.rows, ctx.input.shape[-1], ctx.out_features)
        if why is not None:
            return Support.no(why)
        return fp8_pays(ctx.rows, ctx.input.shape[-1], ctx.out_features)

    def runner(self) -> Any:
        from ..ops.projections import run_joined_fp8

        recipe = self.recipe

        def run(input, weights, biases):
            return run_joined_fp8(input, weights, biases, recipe)

        return run


class Fp8RowwiseProjections(Fp8Projections):
    name = "fp8_rowwise"
    summary = (
        "one GEMM over the joined weights each way with FP8 operands (torch._scaled_mm), "
        "one e4m3 scale per row along each GEMM's contraction"
    )
    recipe = "rowwise"


FP8_MIN_TOKENS = 2048
FP8_MIN_WEIGHT = 2**24
"""Where FP8 GEMMs pay (a stated table, as torchao states its own): at least
``FP8_MIN_TOKENS`` rows and a weight of at least ``FP8_MIN_WEIGHT`` elements (4096 x
4096). Below, the casts (a read of each operand for its amax, another to cast it) and
their launches cost more than the faster GEMMs save. ``bench_fp8.py`` on one H200
(2026-11-28, 8192 tokens, forward and backward against ``F.linear``): Llama-1B's q/k/v
(2048 x 3072) 0.65x and o (2048 x 2048) 0.27x; its gate/up (2048 x 16384) 1.32x and down
(8192 x 2048) 1.31x; Llama-8B's layers 1.32x-1.53x."""


def fp8_pays(rows: int, in_features: int, out_features: int) -> Support:
    """Whether FP8 GEMMs pay at this shape (``FP8_MIN_TOKENS``, ``FP8_MIN_WEIGHT``)."""
    shape = f"{rows} x {in_features} -> {out_features}"
    if rows < FP8_MIN_TOKENS or in_features * out_features < FP8_MIN_WEIGHT:
        return Support.no(
            f"FP8 does not pay below {FP8_MIN_TOKENS} tokens or a 4096 x 4096 weight (the "
            f"casts cost more than the GEMMs save; here {shape})"
        )
    return Support.yes(f"FP8 GEMMs ({shape}: the shape pays)")


def fp8_refusal(device: torch.device) -> str | None:
    """Why ``device`` runs no FP8 GEMMs (None where it does)."""
    if device.type != "cuda":
        return (
            f"FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer, not the {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
    return None

"""The PyTorch kernels a policy chooses among, registered in the KernelRegistry.

Each kernel's ``supports(ctx)`` answers with a reason, using PyTorch's own probes where
they exist (``torch.backends.cuda.can_use_flash_attention(..., debug=True)`` and its
siblings explain a rejection in PyTorch's words).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .._errors import UnsupportedOperationError
from ..kernels import Support, registry
from ..policies._choices import KERNEL_CHOICES
from ._context import (
    AttentionContext,
    DeviceContext,
    LinearContext,
    LossContext,
    MLPContext,
    NormContext,
    ResidualNormContext,
)
from ._switches import SDPA_BACKENDS, only_sdpa_backend

__all__ = ["NONDETERMINISTIC_SDPA", "TorchKernel", "auto_order", "register_kernels"]


def auto_order(op: str) -> list[str]:
    """``op``'s kernels in the auto preference order: the policy vocabulary's order."""
    return [name for name in KERNEL_CHOICES[op] if name != "auto"]


class TorchKernel(ABC):
    """A named choice for one op; subclasses answer ``supports``, and the kernels of a
    routed op (:class:`~._routed.RoutedOp`) run themselves: ``runner()`` gives the
    callable that takes the op's arguments (what the op caches per call signature)."""

    op: ClassVar[str]
    name: ClassVar[str]
    summary: ClassVar[str]

    @abstractmethod
    def supports(self, ctx: Any) -> Support:
        """Can this kernel run ``ctx``? Always with a reason."""

    def runner(self) -> Any:
        """The callable running this kernel on the op's arguments (imports what it
        needs once, so that the call itself does not)."""
        raise UnsupportedOperationError(
            f"{self!r} takes effect through PyTorch's switches; it has no call of its own"
        )

    def run(self, *args: Any) -> Any:
        """Run this kernel on the op's arguments."""
        return self.runner()(*args)

    def __repr__(self) -> str:
        return f"<{self.op} kernel {self.name!r}>"


# -- matmul ----------------------------------------------------------------------------
class _CudaBlas(TorchKernel):
    op = "matmul"
    library: ClassVar[str]

    def supports(self, ctx: DeviceContext) -> Support:
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


class Cublas(_CudaBlas):
    name = "cublas"
    library = "cublas"
    summary = "mm/bmm/baddbmm/addmm without a fused bias through cuBLAS"


class CublasLt(_CudaBlas):
    name = "cublasLt"
    library = "cublaslt"
    summary = "mm/bmm/baddbmm/addmm without a fused bias through cuBLASLt"


class _RunsAnything(TorchKernel):
    """A choice that runs every call of its op (PyTorch's own kernels or routing)."""

    why: ClassVar[str]

    def supports(self, ctx: Any) -> Support:
        return Support.yes(self.why)


class _PyTorchDefault(_RunsAnything):
    """Leave the op to PyTorch's own routing, which runs anywhere."""

    name = "default"
    why = "PyTorch's own routing runs anywhere"


class DefaultMatmul(_PyTorchDefault):
    op = "matmul"
    summary = "PyTorch's startup routing (cuBLAS on CUDA, the CPU BLAS on the CPU)"


# -- attention --------------------------------------------------------------------------
class _SdpaBackend(TorchKernel):
    op = "attention"
    probe: ClassVar[str | None] = None
    nondeterministic_backward: ClassVar[bool] = False

    @property
    def backend(self) -> Any:
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, SDPA_BACKENDS[self.name])

    def supports(self, ctx: AttentionContext) -> Support:
        if ctx.deterministic and ctx.requires_grad and self.nondeterministic_backward:
            return Support.no(
                f"{self.name}'s backward is not deterministic and the policy asks for "
                "deterministic kernels"
            )
        if ctx.device.type == "cuda":
            return self._supports_cuda(ctx)
        return self._supports_host(ctx)

    def _supports_cuda(self, ctx: AttentionContext) -> Support:
        missing = self._missing_library()
        if missing:
            return Support.unavailable(missing)
        probe = getattr(torch.backends.cuda, self.probe or "", None)
        if probe is None:
            return self._ask_pytorch(ctx, "")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = probe(_sdpa_params(ctx), True)
        if ok:
            return Support.yes(f"PyTorch's {self.probe} accepts these inputs")
        reasons = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
        return Support.no(f"PyTorch's {self.probe} refuses: {reasons}")

    def _supports_host(self, ctx: AttentionContext) -> Support:
        return Support.no(f"{self.name} runs on CUDA devices; this is {ctx.device}")

    def _missing_library(self) -> str | None:
        return None

    def _ask_pytorch(self, ctx: AttentionContext, what: str) -> Support:
        """Ask PyTorch's own selector whether this backend alone would run the call."""
        with only_sdpa_backend(self.name):
            choice = torch._fused_sdp_choice(
                ctx.query,
                ctx.key,
                ctx.value,
                ctx.attn_mask,
                ctx.dropout_p,
                ctx.is_causal,
                **({"enable_gqa": True} if ctx.enable_gqa else {}),
            )
        if choice == int(self.backend):
            return Support.yes(f"PyTorch selects {self.name} for these inputs{what}")
        return Support.no(f"PyTorch's selector does not take {self.name} for these inputs{what}")


class FlashV2(_SdpaBackend):
    name = "flash_v2"
    probe = "can_use_flash_attention"
    summary = "PyTorch's FLASH_ATTENTION backend (FlashAttention-2; its C++ port on the CPU)"

    def _missing_library(self) -> str | None:
        available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if not available():
            return f"this torch build ({torch.__version__}) was compiled without FlashAttention"
        return None

    def _supports_host(self, ctx: AttentionContext) -> Support:
        if ctx.device.type != "cpu":
            return Support.no(f"flash_v2 runs on CUDA devices and the CPU, not {ctx.device}")
        if ctx.dropout_p > 0:
            return Support.no("PyTorch's CPU flash kernel has no dropout")
        return self._ask_pytorch(ctx, " (CPU flash kernel)")


class Cudnn(_SdpaBackend):
    name = "cudnn"
    probe = "can_use_cudnn_attention"
    nondeterministic_backward = True
    summary = "PyTorch's CUDNN_ATTENTION backend (cuDNN fused flash attention)"

    def _missing_library(self) -> str | None:
        missing = _cudnn_missing()
        if missing is None and (torch.backends.cudnn.version() or 0) < 90000:
            return f"cuDNN attention needs cuDNN >= 9, found {torch.backends.cudnn.version()}"
        return missing


class Efficient(_SdpaBackend):
    name = "efficient"
    probe = "can_use_efficient_attention"
    summary = "PyTorch's EFFICIENT_ATTENTION backend (xFormers memory-efficient kernels)"


class Math(_SdpaBackend):
    name = "math"
    summary = "PyTorch's MATH backend (bmm + softmax + bmm, in the input precision)"

    def supports(self, ctx: AttentionContext) -> Support:
        return Support.yes("the math backend runs any inputs")


# PyTorch's SDPA backends whose backward is not deterministic.
NONDETERMINISTIC_SDPA = frozenset(
    cls.name for cls in (FlashV2, Cudnn, Efficient, Math) if cls.nondeterministic_backward
)


class TritonAttention(TorchKernel):
    op = "attention"
    name = "triton"
    summary = "xpuruntime's FlashAttention-2-style Triton kernel (forward and backward)"

    def supports(self, ctx: AttentionContext) -> Support:
        refused = _triton_refusal(ctx.device)
        if refused is not None:
            return refused
        from .ops.flash_attention import unsupported

        why = unsupported(ctx.query, ctx.key, ctx.value, ctx.attn_mask, ctx.dropout_p)
        if why is not None:
            return Support.no(why)
        return Support.yes("our Triton kernel takes these inputs (deterministic backward)")


# -- conv --------------------------------------------------------------------------------
class _Cudnn(TorchKernel):
    op = "conv"

    def supports(self, ctx: DeviceContext) -> Support:
        missing = _cudnn_missing()
        if missing is not None:
            return Support.unavailable(missing)
        if ctx.device.type != "cuda":
            return Support.no(f"{self.name} is a cuDNN setting; this is {ctx.device}")
        return self._supports_cudnn(ctx)

    def _supports_cudnn(self, ctx: DeviceContext) -> Support:
        return Support.yes(f"cuDNN {torch.backends.cudnn.version()}")


class CudnnBenchmark(_Cudnn):
    name = "cudnn_benchmark"
    summary = "cuDNN autotuning: each new shape times the algorithms and keeps the fastest"

    def _supports_cudnn(self, ctx: DeviceContext) -> Support:
        if ctx.deterministic:
            return Support.no(
                "autotuning may pick a non-deterministic algorithm and the policy asks "
                "for deterministic kernels"
            )
        return super()._supports_cudnn(ctx)


class CudnnDeterministic(_Cudnn):
    name = "cudnn_deterministic"
    summary = "cuDNN restricted to deterministic algorithms, no autotuning"


class DefaultConv(_PyTorchDefault):
    op = "conv"
    summary = "PyTorch's default convolution routing (cuDNN heuristics on CUDA)"


# -- layernorm, rmsnorm ----------------------------------------------------------------------
class _TorchNorm(_RunsAnything):
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


class _TritonKernel(TorchKernel):
    """One of our Triton kernels: it runs where Triton runs, on fp32, fp16 and bf16."""

    def supports(self, ctx: Any) -> Support:
        from .ops._launch import FLOAT_DTYPES

        refused = _triton_refusal(ctx.device)
        if refused is not None:
            return refused
        dtype = self._dtype(ctx)
        if dtype not in FLOAT_DTYPES:
            return Support.no(f"{self._takes} fp32, fp16 and bf16, not {dtype}")
        return self._supports_triton(ctx)

    @property
    def _takes(self) -> str:
        """The subject and verb of the dtype refusal ("our layernorm kernels take")."""
        return f"our {self.op} kernels take"

    def _dtype(self, ctx: Any) -> torch.dtype:
        return ctx.dtype

    @abstractmethod
    def _supports_triton(self, ctx: Any) -> Support:
        """The kernel's own conditions, once Triton and the dtype are known to fit."""


class _FusedNorm(_TritonKernel):
    name = "fused"

    def _supports_triton(self, ctx: NormContext) -> Support:
        return Support.yes(f"our Triton {self.op} kernels (deterministic, fp32 accumulation)")


class FusedLayerNormKernel(_FusedNorm):
    op = "layernorm"
    summary = "xpuruntime's Triton fused_layernorm (forward and backward)"

    def runner(self) -> Any:
        from .ops.fused_layernorm import run_layernorm

        def run(input, normalized_shape, weight, bias, eps, out_dtype):
            n = math.prod(normalized_shape)
            return run_layernorm(input, n, weight, bias, eps, out_dtype or input.dtype)

        return run


class FusedRMSNormKernel(_FusedNorm):
    op = "rmsnorm"
    summary = "xpuruntime's Triton fused_rmsnorm (forward and backward)"

    def runner(self) -> Any:
        from .ops.fused_rmsnorm import run_rmsnorm

        def run(input, normalized_shape, weight, eps, out_dtype):
            n = math.prod(normalized_shape)
            eps = torch.finfo(input.dtype).eps if eps is None else eps
            return run_rmsnorm(input, n, weight, eps, out_dtype or input.dtype)

        return run


# -- residual_layernorm (a residual add and the layer norm of its sum) ------------------------
class TorchResidualLayerNorm(_RunsAnything):
    op = "residual_layernorm"
    name = "torch"
    summary = "the add, then the norm module (its kernel as the policy's layernorm op picks)"
    why = "PyTorch's add and the norm module take any inputs"

    def runner(self) -> Any:
        def run(input, branch, norm, out_dtype):
            h = input + branch
            return h, norm(h)

        return run


class FusedResidualLayerNormKernel(_TritonKernel):
    op = "residual_layernorm"
    name = "fused"
    summary = "xpuruntime's Triton fused_add_layernorm (the add and the norm in one kernel)"

    def _supports_triton(self, ctx: ResidualNormContext) -> Support:
        from .ops._launch import FLOAT_DTYPES

        if ctx.branch.dtype not in FLOAT_DTYPES:
            return Support.no(f"{self._takes} fp32, fp16 and bf16, not {ctx.branch.dtype}")
        return Support.yes("our Triton add + layer norm kernels (deterministic, fp32 math)")

    def runner(self) -> Any:
        from .ops._launch import MAX_ROW_BLOCK
        from .ops.fused_add_layernorm import fused_add_layernorm, run_add_layernorm

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


# -- cross_entropy (a language-model head's loss) ---------------------------------------------
class TorchCrossEntropy(_RunsAnything):
    op = "cross_entropy"
    name = "torch"
    summary = "F.linear then F.cross_entropy (the logits materialised)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        """None for the loss: the logits are materialised and the model's own
        ``F.cross_entropy`` call runs on them, with its exact arguments."""
        return lambda logits, target, ignore_index, reduction, unsupported: None

    def run(self, logits, target, ignore_index, reduction, unsupported=()) -> torch.Tensor:
        """The loss from the materialised logits (what a timing run measures)."""
        loss = torch.nn.functional.cross_entropy
        return loss(logits.materialize(), target, ignore_index=ignore_index, reduction=reduction)


class FusedLinearCrossEntropyKernel(_TritonKernel):
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
        from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy

        def run(logits, target, ignore_index, reduction, unsupported):
            hidden, dtype, bias = logits._hidden, logits.dtype, logits._bias
            with torch._C.DisableTorchFunctionSubclass():
                return fused_linear_cross_entropy(
                    hidden.to(dtype), logits._weight.to(dtype),
                    target.reshape(hidden.shape[:-1]), None if bias is None else bias.to(dtype),
                    ignore_index=ignore_index, reduction=reduction,
                )  # fmt: skip

        return run


# -- linear ------------------------------------------------------------------------------------
class TorchLinear(_RunsAnything):
    op = "linear"
    name = "torch"
    summary = "F.linear (autocast's casts of the weight and bias gradients included)"
    why = "PyTorch's own kernels take any arguments"

    def runner(self) -> Any:
        return torch.nn.functional.linear


class FusedLinearKernel(_TritonKernel):
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
        from .ops.fused_linear import fused_linear

        return fused_linear


# -- linear_gelu (a linear layer whose output only feeds a GELU) ------------------------------
class TorchLinearGelu(_RunsAnything):
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
        from .ops.fused_linear import fused_linear_gelu

        forward = self.forward

        def run(input, layer, approximate):
            return fused_linear_gelu(input, layer.weight, layer.bias, approximate, forward=forward)

        return run


class _CublasLtEpilogues(TorchKernel):
    """Mixed into our Triton kernels built on cuBLASLt's GELU epilogues (through
    nvmath-python): the library's absence, then the kernel's own refusal."""

    name = "cublaslt"
    why: ClassVar[str]

    def _supports_triton(self, ctx: LinearContext) -> Support:
        from .ops import _cublaslt

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
        from .ops._cublaslt import refusal

        features = (ctx.input.shape[-1], ctx.out_features)
        return refusal(ctx.device, ctx.compute_dtype, *features, ctx.approximate)


# -- mlp (a linear layer, GELU, and a linear layer) -------------------------------------------
class TorchMLP(_RunsAnything):
    op = "mlp"
    name = "torch"
    summary = "the layers as written (the first and its GELU as the linear_gelu op picks)"
    why = "the layers as written take any inputs"

    def runner(self) -> Any:
        return lambda input, fc, proj, approximate, first: proj(first(input))


class CublasLtMLPKernel(_CublasLtEpilogues, _TritonKernel):
    op = "mlp"
    summary = "GELU in one cuBLASLt GEMM's epilogue, its derivative in the next's (fused_mlp)"
    why = (
        "cuBLASLt's GELU_AUX_BIAS and DGELU epilogues, GEMM-written weight gradients and "
        "our Triton column sums"
    )
    _takes = "fused_mlp takes"

    def _refusal(self, ctx: MLPContext) -> str | None:
        from .ops.fused_mlp import mlp_refusal

        features = (ctx.input.shape[-1], ctx.out_features, ctx.proj_out_features)
        return mlp_refusal(ctx.device, ctx.compute_dtype, *features, ctx.approximate)

    def runner(self) -> Any:
        from .ops.fused_mlp import fused_mlp

        def run(input, fc, proj, approximate, first):
            return fused_mlp(input, fc.weight, fc.bias, proj.weight, proj.bias, approximate)

        return run


def _triton_refusal(device: torch.device) -> Support | None:
    """Why our Triton kernels cannot run on ``device`` (None when they can)."""
    from .ops._launch import triton_unavailable

    why = triton_unavailable(device)
    return None if why is None else Support(False, why, missing_backend="not installed" in why)


def _cudnn_missing() -> str | None:
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to this torch build"
    return None


def _sdpa_params(ctx: AttentionContext) -> Any:
    args = (ctx.query, ctx.key, ctx.value, ctx.attn_mask, ctx.dropout_p, ctx.is_causal)
    try:
        return torch.backends.cuda.SDPAParams(*args, ctx.enable_gqa)
    except TypeError:  # torch < 2.5 has no enable_gqa
        return torch.backends.cuda.SDPAParams(*args)


def register_kernels() -> None:
    """Register every PyTorch kernel (idempotent), in each op's auto order."""
    kernels: dict[str, dict[str, TorchKernel]] = {}
    for kernel in (
        CublasLt(),
        Cublas(),
        DefaultMatmul(),
        FlashV2(),
        Cudnn(),
        Efficient(),
        Math(),
        TritonAttention(),
        DefaultConv(),
        CudnnBenchmark(),
        CudnnDeterministic(),
        FusedLayerNormKernel(),
        TorchLayerNorm(),
        FusedRMSNormKernel(),
        TorchRMSNorm(),
        FusedResidualLayerNormKernel(),
        TorchResidualLayerNorm(),
        FusedLinearCrossEntropyKernel(),
        TorchCrossEntropy(),
        FusedLinearKernel(),
        TorchLinear(),
        FusedLinearGeluKernel(),
        CublasLtLinearGeluKernel(),
        TorchLinearGelu(),
        CublasLtMLPKernel(),
        TorchMLP(),
    ):
        kernels.setdefault(kernel.op, {})[kernel.name] = kernel
    for op, named in kernels.items():
        for name in auto_order(op):  # registration order = the auto order
            if name not in registry.names(op):
                registry.register(op, named[name])

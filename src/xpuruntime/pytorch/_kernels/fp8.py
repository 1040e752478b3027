"""The FP8 kernels of the ``linear``, ``projections`` and ``lora_linear`` ops
(:mod:`.._ops.fp8`): their GEMMs with FP8 operands through ``torch._scaled_mm``, one
scale per tensor or per row (a LoRA layer's base GEMMs; its adapters' stay in bf16).
``precision="fp8"`` (or ``"fp8_rowwise"``) puts them first in ``auto``'s order
(:func:`.._selection._policy.precision_order`); each call runs FP8 where the device has
it and the shape pays (the table below), else the next kernel, with the reason."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from ...kernels import Support
from ._base import TorchKernel
from ._context import LinearContext, LoraContext

__all__ = [
    "FP8_MIN_TOKENS",
    "FP8_MIN_WEIGHT",
    "PRECISIONS",
    "Fp8Linear",
    "Fp8Lora",
    "Fp8Projections",
    "Fp8RowwiseLinear",
    "Fp8RowwiseLora",
    "Fp8RowwiseProjections",
    "fp8_pays",
    "fp8_refusal",
]

PRECISIONS = ("fp8", "fp8_rowwise")
"""The policy's FP8 precisions, each also the name of its kernels."""

FP8_MIN_TOKENS = 2048
FP8_MIN_WEIGHT = 2**24
"""Where FP8 GEMMs pay (a stated table, as torchao states its own): at least
``FP8_MIN_TOKENS`` rows and a weight of at least ``FP8_MIN_WEIGHT`` elements (4096 x
4096). Below, the casts (a read of each operand for its amax, another to cast it) and
their launches cost more than the faster GEMMs save. ``bench_fp8.py`` on one H200
(2026-11-28, 8192 tokens, forward and backward against ``F.linear``): Llama-1B's q/k/v
(2048 x 3072) 0.43x and o (2048 x 2048) 0.25x; its gate/up (2048 x 16384) 1.31x and down
(8192 x 2048) 1.27x; Llama-8B's layers 1.33x-1.52x. A 4-bit base (QLoRA's), though made
dense on each call anyway, pays by the same table. On one H200 (2026-11-30) Qwen3-1.7B's
host-bound QLoRA step took 164.6 ms in bf16. With every layer in FP8 it took 185.6, by
the table 171.9 (one call). Llama-3B's took 245.8, 205.2 and 210.5 (the last in a later
call)."""


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


def fp8_pays(rows: int, in_features: int, out_features: int) -> Support:
    """Whether FP8 GEMMs pay at this shape (``FP8_MIN_TOKENS``, ``FP8_MIN_WEIGHT``)."""
    shape = f"{rows} x {in_features} -> {out_features}"
    if rows < FP8_MIN_TOKENS or in_features * out_features < FP8_MIN_WEIGHT:
        return Support.no(
            f"FP8 does not pay below {FP8_MIN_TOKENS} tokens or a 4096 x 4096 weight (the "
            f"casts cost more than the GEMMs save; here {shape})"
        )
    return Support.yes(f"FP8 GEMMs ({shape}: the shape pays)")


class _Fp8(TorchKernel):
    """What the FP8 kernels share: where they run, and their runner (the op's FP8 path
    with the kernel's recipe)."""

    recipe: ClassVar[str] = "tensorwise"

    def runner(self) -> Any:
        from .._ops.fp8 import run_linear
        from .._ops.projections import run_joined_fp8

        path = run_linear if self.op == "linear" else run_joined_fp8
        return functools.partial(path, recipe=self.recipe)

    def supports(self, ctx: LinearContext | LoraContext) -> Support:
        why = fp8_refusal(ctx.device)
        if why is not None:
            return Support.unavailable(why)
        if ctx.compute_dtype not in (torch.bfloat16, torch.float16):
            return Support.no(
                f"FP8 GEMMs here take a bf16 or fp16 compute dtype, not {ctx.compute_dtype}"
            )
        why = self._refusal(ctx)
        if why is not None:
            return Support.no(why)
        from .._ops.fp8 import unsupported

        why = unsupported(ctx.rows, ctx.input.shape[-1], ctx.out_features)
        if why is not None:
            return Support.no(why)
        return self._pays(ctx)

    def _pays(self, ctx: LinearContext | LoraContext) -> Support:
        """Whether FP8 pays for this call (the stated table, :func:`fp8_pays`)."""
        return fp8_pays(ctx.rows, ctx.input.shape[-1], ctx.out_features)

    def _refusal(self, ctx: LinearContext | LoraContext) -> str | None:
        """Why this op's call is not one for FP8, beyond the device and the shape."""
        return None


_TENSORWISE = "with FP8 operands (torch._scaled_mm), one scale per tensor: input and weight e4m3, the output gradient e5m2"  # fmt: skip
_ROWWISE = "with FP8 operands (torch._scaled_mm), one e4m3 scale per row along each GEMM's contraction"  # fmt: skip
_ROWWISE_GRAD = "; the weight gradient's in the compute dtype"


class Fp8Linear(_Fp8):
    op = "linear"
    name = "fp8"
    summary = f"the layer's three GEMMs {_TENSORWISE}"


class Fp8RowwiseLinear(Fp8Linear):
    name = "fp8_rowwise"
    summary = f"the layer's output and input-gradient GEMMs {_ROWWISE}{_ROWWISE_GRAD}"
    recipe = "rowwise"


class Fp8Projections(_Fp8):
    op = "projections"
    name = "fp8"
    summary = f"one GEMM over the joined weights each way {_TENSORWISE}"


class Fp8RowwiseProjections(Fp8Projections):
    name = "fp8_rowwise"
    summary = (
        f"one GEMM over the joined weights for the output and the input gradient "
        f"{_ROWWISE}{_ROWWISE_GRAD}"
    )
    recipe = "rowwise"


_STORED = (
    "; a base stored in FP8 (fp8_base) read as stored, its scales per row; a 4-bit base "
    "(QLoRA) made FP8 by rows in one pass over bitsandbytes' storage, not bf16"
)


class Fp8Lora(_Fp8):
    op = "lora_linear"
    name = "fp8"
    summary = (
        f"the fused LoRA node, its frozen base's two GEMMs (output, input gradient) "
        f"{_TENSORWISE}; the adapters' GEMMs in the compute dtype{_STORED}"
    )

    def _refusal(self, ctx: LoraContext) -> str | None:
        if ctx.trains_base:
            return "FP8 here for a frozen base (LoRA's); this base trains"
        if ctx.four_bit_fp8 is not None:  # (set for a 4-bit base only)
            return f"a 4-bit base (QLoRA) is made FP8 by a Triton pass here: {ctx.four_bit_fp8}"
        return None

    def _pays(self, ctx: LoraContext) -> Support:
        if ctx.stored_fp8:  # (nothing to cast or dequantize: the table does not apply)
            return Support.yes("the base is stored in FP8 (fp8_base): its GEMMs read it as stored")
        # A 4-bit base too: made dense either way, but the casts' launches still cost.
        return super()._pays(ctx)

    def runner(self) -> Any:
        from .._ops.lora_linear import lora_projections

        return functools.partial(lora_projections, fp8=self.recipe)


class Fp8RowwiseLora(Fp8Lora):
    name = "fp8_rowwise"
    summary = (
        f"the fused LoRA node, its frozen base's two GEMMs (output, input gradient) "
        f"{_ROWWISE}; the adapters' GEMMs in the compute dtype{_STORED}"
    )
    recipe = "rowwise"

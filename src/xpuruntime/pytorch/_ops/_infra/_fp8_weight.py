"""Frozen weights stored once in FP8: :class:`Fp8Weight` (the policy's ``fp8_base``).

A LoRA base never changes, yet under ``precision="fp8"`` its FP8 copy is cast from the
16-bit weight on every call, and the 16-bit weight takes 2 bytes a parameter. Stored
once in e4m3 with one fp32 scale per output row (``w ≈ qdata * scale[:, None]``), the
base takes 1 byte a parameter and the ``lora_linear`` op's FP8 GEMMs read it as it is:
the forward ``x W^T`` takes ``qdata`` (K-major, as Hopper's FP8 GEMMs read both
operands) and its row scales; the input gradient ``dY W = (dY diag(scale)) qdata`` folds
the scales into ``dY``'s cast and reads ``qdata`` transposed, one byte each way per call
(:func:`..fp8.stored_input_grad_gemm`).

:class:`Fp8Weight` is a tensor subclass of the weight's shape and 16-bit dtype, so that
whatever else reads the parameter (peft's own forward where the op does not run, an
evaluation, ``state_dict``) gets the dequantized values: any op but those it keeps FP8
(``detach``, ``clone``, a move to another device) runs on ``qdata * scale`` in the
weight's dtype. In-place writes (``load_state_dict``'s ``copy_``, peft's merge) are
quantized back into the stored bytes. What is stored is the rounded weight:
:func:`dense` gives it back, not the original bits.

A group the ``projections`` pattern stored as one tensor (q/k/v, gate and up) is
quantized as one: each weight's ``qdata`` and ``scale`` are views of rows of one
tensor, so that the joined GEMM reads them without a copy (:func:`fp8_joined`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ._joined_storage import stored_joined

__all__ = ["E4M3", "Fp8Weight", "dense", "dequantized", "fp8_joined", "quantize_rows", "store_fp8"]

E4M3 = torch.float8_e4m3fn
_MAX = torch.finfo(E4M3).max
_EPS = 1e-12  # the smallest amax a scale divides by (an all-zero row stores zeros)
_aten = torch.ops.aten
_KEEP = (_aten.detach.default, _aten.alias.default)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` (out, in) in e4m3, one scale per row: ``(qdata, scale)``, ``scale``
    fp32 (out,) with ``weight ≈ qdata * scale[:, None]`` (each row's largest magnitude
    at e4m3's largest value, rounded to nearest even by PyTorch's cast)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=_EPS) / _MAX
    return (w / scale[:, None]).clamp(-_MAX, _MAX).to(E4M3), scale


def dequantized(qdata: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``qdata * scale[:, None]`` in ``dtype`` (a product in fp32, rounded once)."""
    return (qdata.float() * scale[:, None]).to(dtype)


class Fp8Weight(torch.Tensor):
    """A frozen 2-D weight stored as e4m3 ``qdata`` (out, in) and fp32 ``scale`` (out,),
    seen as a tensor of ``dtype`` (see the module's text). Never takes a gradient."""

    qdata: Tensor
    scale: Tensor

    @staticmethod
    def __new__(cls, qdata: Tensor, scale: Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: Tensor, scale: Tensor, dtype: torch.dtype):
        self.qdata, self.scale = qdata, scale

    def __repr__(self) -> str:  # (a tensor's repr would dequantize through dispatch)
        return (f"Fp8Weight(shape={tuple(self.shape)}, e4m3 with a scale per row, "
                f"seen as {self.dtype}, device={self.device})")  # fmt: skip

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Weight(inner["qdata"], inner["scale"], dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``qdata * scale`` in ``dtype`` (default: the weight's)."""
        return dequantized(self.qdata, self.scale, dtype or self.dtype)

    def store(self, values: Tensor) -> None:
        """Quantize ``values`` (the weight's shape) into the stored bytes, in place."""
        qdata, scale = quantize_rows(values.to(self.qdata.device))
        self.qdata.copy_(qdata)
        self.scale.copy_(scale)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _KEEP:
            return Fp8Weight(first.qdata, first.scale, first.dtype)
        if func is _aten.clone.default and not kwargs:  # (copy.deepcopy's)
            return Fp8Weight(first.qdata.clone(), first.scale.clone(), first.dtype)
        if func is _aten._to_copy.default and _a_move(first, kwargs):  # a move keeps FP8
            device, blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
            return Fp8Weight(first.qdata.to(device, non_blocking=blocking),
                             first.scale.to(device, non_blocking=blocking), first.dtype)  # fmt: skip
        if isinstance(first, Fp8Weight) and func._schema.is_mutable:
            # Written in place (copy_, add_): computed on the dense values, stored back.
            values = first.dequantize()
            rest = tree_map(_dense_of, (args[1:], kwargs))
            func(values, *rest[0], **rest[1])
            first.store(values)
            return first
        args, kwargs = tree_map(_dense_of, (args, kwargs))
        return func(*args, **kwargs)


def _a_move(weight: Fp8Weight, kwargs: dict) -> bool:
    """Whether a ``_to_copy`` of ``weight`` with ``kwargs`` only moves it (``.to(device)``,
    ``.cuda()``): the same dtype, a strided layout, no other memory format."""
    return (
        set(kwargs) <= {"device", "dtype", "layout", "non_blocking", "memory_format"}
        and kwargs.get("dtype", weight.dtype) in (None, weight.dtype)
        and kwargs.get("layout", torch.strided) in (None, torch.strided)
        and kwargs.get("memory_format", torch.preserve_format) in (None, torch.preserve_format)
    )


def _dense_of(value):
    return value.dequantize() if isinstance(value, Fp8Weight) else value


def dense(weight: Tensor) -> Tensor:
    """A stored weight's values as a plain tensor of its dtype (others as they are)."""
    return weight.dequantize() if isinstance(weight, Fp8Weight) else weight


def fp8_joined(parts: tuple[Tensor, ...]) -> tuple[Tensor, Tensor] | None:
    """``(qdata, scale)`` of ``parts`` joined by rows, where all are :class:`Fp8Weight`
    (views of one stored tensor: no copy; else a cat of each), else None."""
    if not all(type(p) is Fp8Weight for p in parts):
        return None
    if len(parts) == 1:
        return parts[0].qdata, parts[0].scale
    qdatas, scales = tuple(p.qdata for p in parts), tuple(p.scale for p in parts)
    qdata, scale = stored_joined(qdatas, E4M3), stored_joined(scales, torch.float32)
    if qdata is None or scale is None:  # (autocast's cat takes no FP8 dtype)
        with torch.autocast(qdatas[0].device.type, enabled=False):
            qdata, scale = torch.cat(qdatas), torch.cat(scales)
    return qdata, scale


def store_fp8(weights: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``weights`` (frozen, 2-D, one dtype, device and width) quantized as one tensor
    (:func:`quantize_rows`), one new parameter per weight, each an :class:`Fp8Weight`
    over its rows; the caller puts them in the weights' places."""
    joined = stored_joined(tuple(weights), weights[0].dtype)
    with torch.no_grad():
        if joined is None:
            joined = torch.cat([w.detach() for w in weights])
        qdata, scale = quantize_rows(joined)
    rows = [w.shape[0] for w in weights]
    return [
        torch.nn.Parameter(Fp8Weight(q, s, w.dtype), requires_grad=False)
        for w, q, s in zip(weights, qdata.split(rows), scale.split(rows))
    ]

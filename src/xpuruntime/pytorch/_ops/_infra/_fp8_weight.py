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
weight's dtype. A whole write (``copy_``: ``load_state_dict``, DDP's broadcast) is
quantized into the stored bytes. Any other in-place op (peft's merge, an ``add_``) is
refused, naming ``revert``. Its result, rounded to e4m3 again, would lose a small update
such as a merge's. What is stored is the rounded weight: :func:`dense` gives it back,
not the original bits. Pickled (``torch.save`` of a ``state_dict`` or a module) it is
that plain tensor, a parameter where it is one. So a checkpoint loads without this
package, under ``torch.load``'s default ``weights_only`` too. ``copy.deepcopy`` clones
it and stays FP8.

A group the ``projections`` pattern stored as one tensor (q/k/v, gate and up) is
quantized as one: each weight's ``qdata`` and ``scale`` are views of rows of one
tensor, so that the joined GEMM reads them without a copy (:func:`fp8_joined`).

A stored weight sharded by FSDP2 (``fully_shard``, :func:`~...distributed.shard`) stays
FP8. Each rank keeps whole rows with their scales: the ops FSDP2 shards a parameter with
(a split, slice or copy along the rows, a new zero block) keep FP8. FSDP2 gathers the
bytes and scales through its extension for tensor subclasses (``fsdp_pre_all_gather``,
``fsdp_post_all_gather``), as torchao's FP8 weights do: half a bf16 gather's bytes.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ...._errors import UnsupportedOperationError
from ._joined_storage import stored_joined

__all__ = [
    "E4M3",
    "Fp8Weight",
    "dense",
    "dequantized",
    "fp8_joined",
    "fp8_scales",
    "quantize_rows",
    "store_fp8",
]

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
    """``qdata * scale[:, None]`` in ``dtype`` (a product in fp32, rounded once); a
    flat ``qdata`` (an :class:`Fp8Weight`'s flat view) is read as rows of its scales."""
    if qdata.dim() == 2:
        return (qdata.float() * scale[:, None]).to(dtype)
    rows = qdata.float().view(scale.shape[0], -1)
    return (rows * scale[:, None]).to(dtype).view(qdata.shape)


class Fp8Weight(torch.Tensor):
    """A frozen 2-D weight stored as e4m3 ``qdata`` (out, in) and fp32 ``scale`` (out,),
    seen as a tensor of ``dtype`` (see the module's text); its flat view (``qdata`` of
    out x in bytes, the same scales) is one too. Never takes a gradient."""

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

    def __reduce_ex__(self, protocol):
        dense = self.dequantize()  # (saved as its values: see the module's text)
        if getattr(self, "_is_param", False):
            dense = torch.nn.Parameter(dense, requires_grad=False)
        return dense.__reduce_ex__(protocol)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``qdata * scale`` in ``dtype`` (default: the weight's)."""
        return dequantized(self.qdata, self.scale, dtype or self.dtype)

    def store(self, values: Tensor) -> None:
        """Quantize ``values`` (the weight's shape) into the stored bytes, in place."""
        rows = values.to(self.qdata.device).reshape(self.scale.shape[0], -1)
        qdata, scale = quantize_rows(rows)
        self.qdata.copy_(qdata.view(self.qdata.shape))
        self.scale.copy_(scale)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 gathers for this shard: its FP8 bytes and row scales, seen as the
        dtype the block gathers in (``mp_policy``'s, else the weight's). With mixed
        dtypes FSDP2 views every tensor of the block as bytes, host calls each gather."""
        like = getattr(mp_policy, "param_dtype", None) or self.dtype
        return (_seen_as(self.qdata, like), _seen_as(self.scale, like)), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight over FSDP2's gathered bytes and scales (``out``, the one
        made by the first gather, reads them again: nothing to do)."""
        if out is not None:
            return None
        qdata, scale = outputs[0].view(E4M3), outputs[1].view(torch.float32)
        return Fp8Weight(qdata, scale, param_dtype or self.dtype), (qdata, scale)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _KEEP:
            return Fp8Weight(first.qdata, first.scale, first.dtype)
        rows = _by_rows(func, args, kwargs)
        if rows is not None:
            return rows
        if func is _aten.clone.default and not kwargs:  # (copy.deepcopy's)
            return Fp8Weight(first.qdata.clone(), first.scale.clone(), first.dtype)
        if func is _aten._to_copy.default and _a_move(first, kwargs):  # a move keeps FP8
            device, blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
            return Fp8Weight(first.qdata.to(device, non_blocking=blocking),
                             first.scale.to(device, non_blocking=blocking), first.dtype)  # fmt: skip
        if isinstance(first, Fp8Weight) and func._schema.is_mutable:
            if func is not _aten.copy_.default:
                raise UnsupportedOperationError(
                    f"{func._schema.name} in place on a weight stored in FP8 (the policy's "
                    "fp8_base) would round its result to e4m3 again and lose a small "
                    "update (a LoRA merge's); call revert() on optimize's report first "
                    "(it gives back dense weights), or write the weight whole (copy_, "
                    "load_state_dict)"
                )
            values = torch.empty_like(first.qdata, dtype=first.dtype)  # (a whole write)
            values.copy_(_dense_of(args[1]), **kwargs)
            first.store(values)
            return first
        args, kwargs = tree_map(_dense_of, (args, kwargs))
        return func(*args, **kwargs)


# FSDP2 reads the hook's signature on every gather of every stored weight
# (``inspect.signature``: about 17 us a call; 5 where the function carries it).
Fp8Weight.fsdp_pre_all_gather.__signature__ = inspect.signature(Fp8Weight.fsdp_pre_all_gather)


def _seen_as(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor``'s bytes seen as ``dtype`` (no copy) where its rows divide into it,
    else ``tensor`` itself."""
    if tensor.dtype == dtype or tensor.dim() == 0 or tensor.stride(-1) != 1:
        return tensor
    ratio = dtype.itemsize // tensor.element_size()
    if ratio > 1 and (tensor.shape[-1] % ratio or tensor.storage_offset() % ratio):
        return tensor
    return tensor.view(dtype)


_SPLITS = (_aten.split.Tensor, _aten.split_with_sizes.default)


def _by_rows(func, args: tuple, kwargs: dict):
    """An op over whole rows of a stored weight, done on its bytes and scales alike so
    that the result stays FP8 (what FSDP2 shards a parameter with); None for any other
    op or form."""
    first = args[0]
    if not isinstance(first, Fp8Weight) or first.dim() != 2:
        return None
    shape, dtype = tuple(first.shape), first.dtype
    if func in _SPLITS and _argument(args, kwargs, 2, "dim", 0) == 0:
        qdatas = func(first.qdata, *args[1:], **kwargs)
        scales = func(first.scale, *args[1:], **kwargs)
        return [Fp8Weight(q, s, dtype) for q, s in zip(qdatas, scales)]
    if func is _aten.slice.Tensor and _argument(args, kwargs, 1, "dim", 0) == 0:
        if _argument(args, kwargs, 4, "step", 1) == 1:
            return Fp8Weight(func(first.qdata, *args[1:], **kwargs),
                             func(first.scale, *args[1:], **kwargs), dtype)  # fmt: skip
    if func is _aten.new_zeros.default and len(args[1]) == 2 and args[1][1] == shape[1]:
        same = kwargs.get("dtype", dtype) in (None, dtype) and not kwargs.get("pin_memory")
        if same and kwargs.get("device", first.device) in (None, first.device):
            rows = args[1][0]
            return Fp8Weight(first.qdata.new_zeros((rows, shape[1])),
                             first.scale.new_zeros((rows,)), dtype)  # fmt: skip
    if func is _aten.copy_.default and isinstance(args[1], Fp8Weight):
        if tuple(args[1].shape) == shape:
            first.qdata.copy_(args[1].qdata)
            first.scale.copy_(args[1].scale)
            return first
    if func is _aten.as_strided.default and tuple(args[1]) == shape:
        offset = _argument(args, kwargs, 3, "storage_offset", 0)
        if tuple(args[2]) == (shape[1], 1) and not offset:
            return Fp8Weight(first.qdata, first.scale, dtype)
    if func is _aten.view.default and tuple(args[1]) in ((-1,), (first.numel(),)):
        # A flat view over the same bytes and scales (FSDP2 keeps one of each shard),
        # not a dequantized copy (2 bytes a parameter).
        return Fp8Weight(first.qdata.view(-1), first.scale, dtype)
    return None


def _argument(args: tuple, kwargs: dict, at: int, name: str, default):
    return args[at] if len(args) > at else kwargs.get(name, default)


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
    return _joined(tuple(p.qdata for p in parts), E4M3), fp8_scales(parts)


def fp8_scales(parts: tuple[Fp8Weight, ...]) -> Tensor:
    """The row scales of stored ``parts`` joined, as :func:`fp8_joined` joins them."""
    return _joined(tuple(p.scale for p in parts), torch.float32)


def _joined(tensors: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    if len(tensors) == 1:
        return tensors[0]
    joined = stored_joined(tensors, dtype)
    if joined is None:  # (autocast's cat takes no FP8 dtype)
        with torch.autocast(tensors[0].device.type, enabled=False):
            joined = torch.cat(tensors)
    return joined


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

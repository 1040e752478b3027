"""A weight FSDP2 gathered in FP8 (``xpt.distributed.shard``'s ``fp8_gather``:
:mod:`...distributed._fp8_gathers` casts each rank's shard before the gather).

:class:`Fp8Gathered` is the gathered weight the module holds during its forward and
backward: e4m3 bytes and one inverse scale, seen as the compute dtype. The FP8 linear op
reads them as they are (:func:`gathered`: a joined GEMM's weights share one scale, so
their bytes are joined by rows); any other op (a call FP8 does not take: a bf16 kernel, a
shape not divisible by 16) runs on the dequantized values, the weight rounded to e4m3
(:func:`plain`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

__all__ = ["Fp8Gathered", "gathered", "plain"]

_aten = torch.ops.aten


class Fp8Gathered(torch.Tensor):
    """A gathered weight: e4m3 ``data`` (out, in) and its fp32 ``inverse`` scale (the
    weight is ``data * inverse``), seen as ``dtype``; ``group`` as its shards'."""

    data_fp8: Tensor
    inverse: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, inverse: Tensor, group: int, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: Tensor, inverse: Tensor, group: int, dtype: torch.dtype):
        self.data_fp8, self.inverse, self.group = data, inverse, group

    def __repr__(self) -> str:
        return (f"Fp8Gathered(shape={tuple(self.shape)}, e4m3 with one scale, seen as "
                f"{self.dtype}, device={self.device})")  # fmt: skip

    def dequantize(self) -> Tensor:
        """``data * inverse`` in the weight's dtype."""
        return (self.data_fp8.float() * self.inverse).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, Fp8Gathered) and _itself(func, args, first):
            return Fp8Gathered(first.data_fp8, first.inverse, first.group, first.dtype)
        args, kwargs = tree_map_only(Fp8Gathered, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _itself(func, args: tuple, weight: Fp8Gathered) -> bool:
    """Whether ``func(*args)`` gives ``weight`` itself: autograd's detach or alias, or
    FSDP2's as_strided to its own shape and strides at offset 0."""
    if func in (_aten.detach.default, _aten.alias.default):
        return True
    offset = args[3] if len(args) > 3 else None
    return (
        func is _aten.as_strided.default
        and tuple(args[1]) == tuple(weight.shape)
        and tuple(args[2]) == weight.data_fp8.stride()
        and not offset
    )


def gathered(weights: tuple[Tensor, ...]) -> tuple[Tensor, Tensor] | None:
    """``(e4m3 data joined by rows, inverse scale)`` where ``weights`` are gathered in
    FP8 as one group (one amax), else None."""
    first = weights[0]
    if not all(type(w) is Fp8Gathered and w.group == first.group for w in weights):
        return None
    if len(weights) == 1:
        return first.data_fp8, first.inverse
    with torch.autocast(first.device.type, enabled=False):  # (no FP8 dtype in its cat)
        return torch.cat([w.data_fp8 for w in weights]), first.inverse


def plain(weights: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``weights`` with any gathered in FP8 dequantized (a call that cannot read them as
    they are)."""
    return tuple(w.dequantize() if type(w) is Fp8Gathered else w for w in weights)

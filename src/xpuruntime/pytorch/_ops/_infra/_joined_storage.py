"""Frozen weights of one joined GEMM stored as the rows of one tensor.

The ``projections`` and ``lora_linear`` ops run attention's q/k/v (an MLP's gate and
up) as one GEMM over their weights joined. Where those weights are frozen (a LoRA
base), a copy joining them in every forward and backward rewrites what has not
changed: 63 copies of up to 67 MB a step on Llama-3.2-1B.

:func:`store_joined` moves such weights, once, into consecutive rows of one new tensor.
Each parameter's ``.data`` becomes a view of its rows; no memory is added once the old
storage is freed. :func:`stored_joined` then finds them there and hands the GEMM that
tensor without a copy.

:func:`stored_joined` reads where the weights lie at each call, so nothing goes stale.
An in-place write (``copy_``, peft's merge) lands in the joined rows. A weight given
new data (``load_state_dict(assign=True)``, ``.to()``) is joined by a copy again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["join_weights", "store_joined", "stored_joined"]


def join_weights(parts: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """``torch.cat(parts)`` in ``dtype``: the cast and the join in one copy; no copy
    where they are stored joined (:func:`stored_joined`) or one part is already in
    ``dtype``."""
    if len(parts) == 1:
        return parts[0].to(dtype)
    stored = stored_joined(parts, dtype)
    if stored is not None:
        return stored
    rows = sum(p.shape[0] for p in parts)
    out = parts[0].new_empty((rows, *parts[0].shape[1:]), dtype=dtype)
    return torch.cat(parts, out=out)


def stored_joined(parts: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor | None:
    """``torch.cat(parts)`` without a copy, where ``parts`` are in ``dtype`` and lie
    one after another in one storage (as :func:`store_joined` leaves them); else
    None (under ``torch.compile``, which cannot trace storage addresses, too)."""
    first = parts[0]
    if len(parts) < 2 or first.dtype != dtype or torch.compiler.is_compiling():
        return None
    if not first.is_contiguous():
        return None
    storage, tail = first.untyped_storage().data_ptr(), first.shape[1:]
    step = first.element_size() * math.prod(tail)
    address, rows = first.data_ptr(), 0
    for p in parts:
        if (p.dtype != dtype or p.shape[1:] != tail or not p.is_contiguous()
                or p.data_ptr() != address + rows * step
                or p.untyped_storage().data_ptr() != storage):  # fmt: skip
            return None
        rows += p.shape[0]
    return first.detach().as_strided((rows, *tail), first.stride())


def store_joined(weights: list[Tensor]) -> bool:
    """Move ``weights`` (parameters) into consecutive rows of one new tensor, each one's
    ``.data`` a view of its rows, where they are frozen dense tensors of one dtype,
    device and row shape, each in a storage of its own; return whether they were moved
    (or already lay so). Whatever else holds their old storage keeps it unchanged."""
    if stored_joined(tuple(weights), weights[0].dtype) is not None:
        return True
    first = weights[0]
    if len(weights) < 2 or not _movable(weights):
        return False
    storages = {w.untyped_storage().data_ptr() for w in weights}
    if len(storages) != len(weights):
        return False  # one shares another's storage (tied, or already views)
    with torch.no_grad():
        joined = torch.cat([w.detach() for w in weights])
        for weight, rows in zip(weights, joined.split([w.shape[0] for w in weights])):
            weight.data = rows
    return stored_joined(tuple(weights), first.dtype) is not None


def _movable(weights: list[Tensor]) -> bool:
    first = weights[0]
    for w in weights:
        if (
            type(w) is not torch.nn.Parameter  # (a DTensor's, bitsandbytes', one computed)
            or type(w.data) is not torch.Tensor
            or w.requires_grad
            or not w.is_floating_point()
            or w.is_meta
            or torch.is_inference(w)
            or w.dim() < 2
            or w.dtype != first.dtype
            or w.device != first.device
            or w.shape[1:] != first.shape[1:]
        ):
            return False
    return True

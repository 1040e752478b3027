"""Casts of frozen weights kept from one call to the next.

Under autocast a frozen fp32 base (LoRA's, or layers a user froze) is cast to bf16 in
every forward, and the cast copy is kept for the backward: at the step's peak every
layer's copy is alive anyway. Kept between steps instead, the copy is made once, at no
cost to the peak: a frozen weight does not change between steps.

A kept copy is used only while it is exactly what the cast would give now: keyed on the
weights themselves (the same objects), their storage address, shape, strides and
version counter (any in-place write, an optimizer's, ``load_state_dict``'s or
``copy_``'s, moves it), and the dtype. Nothing is kept where that key cannot be
trusted or where keeping would cost memory the caller is saving:

- a weight that trains (it changes every step), an inference tensor, or a packed one
  (QLoRA's 4-bit base: not keeping a dense copy is its point);
- no autograd (an evaluation's cast is not kept for a backward, so keeping would add
  it), a forward recomputed inside the backward (reentrant checkpointing), or saved
  tensors under hooks (non-reentrant checkpointing, offloading: they free or move
  what the backward keeps);
- ``torch.compile``'s tracing and CUDA graph capture (the cast then belongs to the
  graph, which replays it);
- a process group (``torch.distributed``): FSDP2 writes each gathered weight in place
  while keeping its version counter, so a cast cannot be told current there.

:func:`frozen_scale` keeps Gemma's RMSNorm scale, ``1 + weight`` in fp32, of a frozen
norm weight (LoRA's norms; every norm while generating) under the same key. Made on each
call it is two launches, in every norm call and in each recompute of a norm's output:
about 370 a step on Gemma3-1B. It is a vector the size of the norm's width, so evaluation,
backward recomputes and saved-tensor hooks may keep it too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ._capture_paths import capture_paths

__all__ = ["forget_frozen_casts", "frozen_cast", "frozen_scale"]

_kept = WeakIdKeyDictionary()  # the first weight -> (its parts, key, copy)
_scales = WeakIdKeyDictionary()  # a norm's weight -> (key, its scale)
_graph_task = torch._C._current_graph_task_id
_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def frozen_cast(
    parts: tuple[Tensor, ...], dtype: torch.dtype, make: Callable[..., Tensor]
) -> Tensor | None:
    """``make(parts, dtype)`` (``parts`` cast to ``dtype``, joined where several), kept
    from the last call where it is still exact, where ``parts`` are frozen weights whose
    copy may be kept (see the module's text); else None (the caller casts). Called
    outside autograd Functions, whose forwards run without autograd."""
    if torch.compiler.is_compiling() or not _keepable(parts, dtype):
        return None  # (asked first: what follows would break a trace)
    key = (dtype, tuple((p.data_ptr(), tuple(p.shape), p.stride(), p._version) for p in parts))
    found = _kept.get(parts[0])
    if found is not None:
        refs, kept_key, copy = found
        if kept_key == key and all(r() is p for r, p in zip(refs, parts)):
            return copy
    with torch.no_grad():
        copy = make(parts, dtype)
    _kept[parts[0]] = (tuple(weakref.ref(p) for p in parts), key, copy)
    return copy


def frozen_scale(weight: Tensor | None, offset: float) -> Tensor | None:
    """What an RMS norm with ``offset`` (Gemma's 1) multiplies by: ``weight.float() +
    offset``, kept from the last call while ``weight`` is a frozen weight the key can
    tell current (see the module's text); the weight itself without an offset."""
    if not offset or weight is None:
        return weight
    if not _scale_keepable(weight):
        return weight.float() + offset
    key = (offset, weight.data_ptr(), tuple(weight.shape), weight.stride(), weight._version)
    found = _scales.get(weight)
    if found is not None and found[0] == key:
        return found[1]
    # (never an inference tensor, whatever mode first made it: a training call saves it)
    with torch.no_grad(), torch.inference_mode(False):
        scale = weight.float() + offset
    _scales[weight] = (key, scale)
    return scale


def forget_frozen_casts() -> None:
    """Drop every kept copy (``OptimizationReport.revert``: the model then runs as
    written, and a copy kept for it would only hold memory)."""
    _kept.clear()
    _scales.clear()


def _scale_keepable(weight: Tensor) -> bool:
    """:func:`_keepable`'s conditions that keep a kept copy current, without those that
    save memory (a norm's scale is a vector)."""
    if weight.requires_grad or torch.is_inference(weight) or torch.compiler.is_compiling():
        return False
    if capture_paths(weight.device):
        return False
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized())


def _keepable(parts: tuple[Tensor, ...], dtype: torch.dtype) -> bool:
    if not any(p.dtype != dtype for p in parts):
        return False  # no cast: nothing to keep
    if not all(p.is_floating_point() for p in parts):
        return False  # packed (a 4-bit base): its dequantized copy is what it saves
    if any(p.requires_grad or torch.is_inference(p) for p in parts):
        return False
    if not torch.is_grad_enabled() or _graph_task() != -1 or _hooks(False) is not None:
        return False
    if capture_paths(parts[0].device):
        return False
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized())

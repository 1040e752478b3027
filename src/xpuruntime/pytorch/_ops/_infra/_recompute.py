"""Outputs an op's backward can compute again from tensors kept anyway.

A gated MLP's activation ``h = act(gate) * up`` keeps gate and up for its own backward;
the down projection after it keeps ``h`` for its weight's (or its adapter's) gradient:
an activation-sized tensor per layer held twice over (2 GiB on Llama-3.2-1B's 16 layers
at B4 x T2048 in bf16). Where the activation marks its output with how to make it again,
the down projection keeps the activation's inputs instead and recomputes ``h`` in its
backward (one elementwise pass), as Unsloth's LoRA MLP does. Where that backward needs
``h`` only for an adapter's gradient ``m^T h``, the activation's kernel gives the
product from gate and up, ``h`` never made. Our RMS norms mark their output the same
way (:func:`..fused_rmsnorm.mark_normed`). The LoRA op after a norm then
keeps the norm's input, which the norm keeps anyway, and normalises it again in its
backward: 31 activations less on Llama-3.2-1B's 16 layers (1 GiB at B4 x T2048).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Recompute", "mark_recomputable", "recomputable"]

_ATTRIBUTE = "_xpuruntime_recompute"


class Recompute(NamedTuple):
    """How to have an output again. ``function(*inputs)`` makes it. ``product(m,
    *inputs)``, where the maker has one, gives ``m^T @ output`` in fp32 without making
    it (``m``: a row per output row), or None where it does not take that ``m``."""

    function: Callable[..., Tensor]
    inputs: tuple[Tensor, ...]
    product: Callable[..., Tensor] | None


def mark_recomputable(
    output: Tensor,
    function: Callable[..., Tensor],
    *inputs: Tensor,
    product: Callable[..., Tensor] | None = None,
) -> None:
    """Say that ``function(*inputs)`` gives ``output`` again, and ``product(m, *inputs)``
    its left product (while autograd records, outside a trace: a traced attribute would
    break the graph)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        setattr(output, _ATTRIBUTE, Recompute(function, inputs, product))


def recomputable(tensor: Tensor) -> Recompute | None:
    """How ``tensor`` can be had again, or None."""
    return getattr(tensor, _ATTRIBUTE, None)

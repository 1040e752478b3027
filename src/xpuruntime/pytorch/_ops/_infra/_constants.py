"""Small constant tensors an op passes on every call (a GEMM's unread input, a row of
ones for a scale), made once per device, dtype and shape: an allocation and a fill cost
the host about what a small launch does. Under a ``torch.compile`` trace or a CUDA
graph's capture, which own what they allocate, one is made anew and not kept."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._capture_paths import capture_paths

__all__ = ["constant"]

_KEPT: dict[tuple, Tensor] = {}


def constant(key: tuple, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
    """The tensor ``make()`` gives for ``key`` (which must name everything its values,
    dtype, shape and ``device`` depend on), made on the first call and kept; never
    written by its readers."""
    if torch.compiler.is_compiling():
        return make()
    found = _KEPT.get(key)
    if found is None:
        found = make()
        if not capture_paths(device):
            found = _KEPT.setdefault(key, found)  # (one winner where threads race)
    return found

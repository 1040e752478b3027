"""Whether the ops take the paths they take inside a CUDA graph capture.

Some ops run other code while a graph is captured. They keep no copy between calls (a
frozen cast, a norm's scale, a constant) and derive no launch plan. Some run our own
reductions where PyTorch's would win eagerly. A warm-up that never takes those paths
leaves their kernels to be compiled and loaded inside the capture. The driver refuses
that: a module loaded while a stream captures invalidates the capture. So a graph's
last warm-up run may rehearse the capture (:func:`rehearsal`). The ops then take the
capture's paths eagerly, and their kernels are ready before the capture begins.

The rehearsal holds for every thread (autograd's device thread runs the warm-up's
backward): another thread's call meanwhile takes the capture's paths too, which compute
the same values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["capture_paths", "rehearsal"]

_rehearsals = 0
_lock = threading.Lock()


def capture_paths(device: torch.device) -> bool:
    """Whether an op on ``device`` takes the capture's paths now: a graph is being
    captured on the current stream, or rehearsed (False off CUDA)."""
    return device.type == "cuda" and (_rehearsals > 0 or torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """Within the block, the ops take the paths of a capture (see the module text)."""
    global _rehearsals
    with _lock:
        _rehearsals += 1
    try:
        yield
    finally:
        with _lock:
            _rehearsals -= 1

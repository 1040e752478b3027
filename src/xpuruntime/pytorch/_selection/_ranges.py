"""Named ranges for xpuruntime's own events (policy changes, kernel decisions).

They show up in a :func:`~xpuruntime.pytorch.profile` trace (through
``torch.profiler.record_function``) and in Nsight Systems (through NVTX, when the
``nvtx`` package is installed and an NVTX tool is attached: see
:func:`xpuruntime.runtime._profiler.load_nvtx`). Otherwise they cost one check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ...runtime._profiler import Profiler, load_nvtx

__all__ = ["annotate", "profiling", "ranges_active"]

_active_profiles = 0
_nvtx = load_nvtx()
_profiler = Profiler.instance()


def profiling(delta: int) -> None:
    """Count a :func:`profile` block in (+1) or out (-1)."""
    global _active_profiles
    _active_profiles += delta


_NOTHING = contextlib.nullcontext()


def ranges_active() -> bool:
    """Whether :func:`annotate` records anything (a profile is open, xpuruntime's
    Profiler records, or an NVTX tool listens)."""
    return _profiler.recording or bool(_active_profiles) or _nvtx is not None


def annotate(name: str) -> contextlib.AbstractContextManager:
    """A range named ``xrt::<name>`` in the active trace, in :class:`xrt.Profiler`'s
    trace while it records, and in NVTX."""
    if _profiler.recording:  # its ranges reach torch.profiler and NVTX too
        return _profiler.range(f"xrt::{name}", "pytorch")
    if not _active_profiles and _nvtx is None:
        return _NOTHING
    return _ranged(name)


@contextlib.contextmanager
def _ranged(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if _active_profiles:
            stack.enter_context(torch.profiler.record_function(f"xrt::{name}"))
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(f"xrt::{name}", domain="xpuruntime"))
        yield

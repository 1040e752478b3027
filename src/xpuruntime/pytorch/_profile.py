"""torch.profiler around a region, with xpuruntime's own ranges in the same trace."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..runtime._profiler import Profiler
from ._ranges import profiling

__all__ = ["profile"]


@contextlib.contextmanager
def profile(
    export_chrome_trace: str | os.PathLike[str] | None = None,
    *,
    activities: Sequence[Any] | None = None,
    record_shapes: bool = True,
    with_stack: bool = False,
    profile_memory: bool = False,
) -> Iterator[torch.profiler.profile]:
    """Profile the block: PyTorch's ops and kernels plus xpuruntime's ranges
    (``xrt::set_kernel_policy ...``, ``xrt::resolve attention``,
    ``xrt::attention[<kernel>]``, ``xrt::autocast ...``), and the ranges opened with
    :class:`xpuruntime.Profiler` (sessions, ``Profiler.range``), which record into
    xpuruntime's own trace at the same time.

    Parameters
    ----------
    export_chrome_trace : path, optional
        Where to write the Chrome/Perfetto trace (atomically) when the block ends;
        xpuruntime's own trace (its ranges and decisions) goes next to it, as
        ``<name>_xrt.json`` (05_training_module §7.1).
    activities : list of torch.profiler.ProfilerActivity, optional
        Default: CPU, plus CUDA when available.
    record_shapes, with_stack, profile_memory : bool
        Passed to ``torch.profiler.profile``.

    Yields
    ------
    torch.profiler.profile
        For ``key_averages()`` and the other profiler queries.

    Examples
    --------
    >>> with xpt.profile(export_chrome_trace="trace.json"):     # doctest: +SKIP
    ...     model(batch).sum().backward()
    """
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=list(activities),
        record_shapes=record_shapes,
        with_stack=with_stack,
        profile_memory=profile_memory,
    )
    xrt_profiler = Profiler.instance()
    was_recording = xrt_profiler.enabled
    xrt_profiler.enable()
    previous = xrt_profiler.mirror_ranges(torch.profiler.record_function)
    profiling(+1)
    try:
        with prof:
            yield prof
    finally:
        profiling(-1)
        xrt_profiler.mirror_ranges(previous)
        if not was_recording:
            xrt_profiler.disable()
    if export_chrome_trace is not None:
        target = Path(export_chrome_trace)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            prof.export_chrome_trace(temp)
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        xrt_profiler.export_chrome_trace(target.with_name(f"{target.stem}_xrt{target.suffix}"))

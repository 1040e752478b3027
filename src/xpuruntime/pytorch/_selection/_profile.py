"""torch.profiler around a region, with xpuruntime's own ranges in the same trace."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ...runtime._profiler import Profiler
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

    Notes
    -----
    Once a profile with CUDA activity has run, the process keeps its CUDA contexts until
    it ends instead of destroying them in the CUDA runtime's exit handler: with torch
    2.11's Kineto, destroying them there could abort the exit with "double free or
    corruption" after all the work was done.

    Examples
    --------
    >>> with xpt.profile(export_chrome_trace="trace.json"):     # doctest: +SKIP
    ...     model(batch).sum().backward()
    """
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
    if torch.profiler.ProfilerActivity.CUDA in activities and torch.cuda.is_available():
        _keep_cuda_contexts_through_exit()
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


@functools.cache
def _keep_cuda_contexts_through_exit() -> None:
    """Once a CUDA profile ran, hold one more reference to each active primary context
    at interpreter exit, so that the CUDA runtime's own exit handler does not destroy it.

    Why: in torch 2.11 (Kineto before pytorch/kineto#1350) Kineto's CUPTI callback
    singleton is a static ``shared_ptr`` destroyed among the C exit handlers, and when
    the runtime's handler destroys the primary context afterwards, CUPTI's context-destroy
    callback reaches the destroyed singleton: "double free or corruption" after all the
    work is done (H200, 2026-11-24: 4 aborts in about 40 runs of the GPU training tests
    without this, none in about 60 with it). A context left to the process's end is
    reclaimed by the driver as at any exit. Python's exit functions run before the C exit
    handlers."""
    atexit.register(_retain_active_primary_contexts)


def _retain_active_primary_contexts() -> None:
    if not torch.cuda.is_initialized():
        return
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no Linux driver library: not the exit this works around
        return
    for index in range(torch.cuda.device_count()):
        device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if driver.cuDeviceGet(ctypes.byref(device), index) != 0:
            continue
        state = driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
        if state == 0 and active.value:  # an inactive one would be created, not kept
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctypes.c_void_p()), device)

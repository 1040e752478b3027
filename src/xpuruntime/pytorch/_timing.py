"""Timing PyTorch work on its device: CUDA events on a GPU, the wall clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["time_call"]


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    min_iterations: int = 5,
    min_seconds: float = 0.05,
    max_iterations: int = 200,
) -> float:
    """Median seconds per call of ``fn`` on ``device``, after ``warmup`` calls."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_iterations and (
        len(samples) < min_iterations or time.perf_counter() - started < min_seconds
    ):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)

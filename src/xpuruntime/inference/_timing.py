"""Latency measurement shared by auto selection, the CLI and the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["LatencyStats", "measure_latency"]


@dataclass(frozen=True)
class LatencyStats:
    """Per-call latencies in seconds, with the usual percentiles."""

    samples: tuple[float, ...]

    @property
    def p50(self) -> float:
        return float(np.percentile(self.samples, 50))

    @property
    def p90(self) -> float:
        return float(np.percentile(self.samples, 90))

    @property
    def p99(self) -> float:
        return float(np.percentile(self.samples, 99))

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples))

    @property
    def throughput(self) -> float:
        """Calls per second at the mean latency."""
        return 1.0 / self.mean if self.mean > 0 else float("inf")


def measure_latency(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    min_iterations: int = 10,
    max_iterations: int = 1000,
    min_seconds: float = 0.2,
    on_iteration: Callable[[int], None] | None = None,
) -> LatencyStats:
    """Call ``fn`` ``warmup`` times, then until both ``min_iterations`` calls and
    ``min_seconds`` have passed (at most ``max_iterations``), timing each call."""
    for _ in range(warmup):
        fn()
    samples = []
    started = time.perf_counter()
    while len(samples) < max_iterations and (
        len(samples) < min_iterations or time.perf_counter() - started < min_seconds
    ):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if on_iteration is not None:
            on_iteration(len(samples))
    return LatencyStats(tuple(samples))

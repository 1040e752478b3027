"""Latency statistics of an engine's runs (auto selection, the CLI, the benchmarks),
sampled by the loop that kernels are timed with too (:mod:`xpuruntime._timing`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._timing import sample

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
    samples = sample(
        fn,
        warmup=warmup,
        min_iterations=min_iterations,
        max_iterations=max_iterations,
        min_seconds=min_seconds,
        on_sample=on_iteration,
    )
    return LatencyStats(tuple(samples))

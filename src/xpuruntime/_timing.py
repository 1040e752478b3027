"""Timing loops shared by engines and kernels: samples until enough calls and time have
passed, and interleaved comparisons of several callables.

What one sample measures is the caller's: the wall clock around one call by default
(an engine's run, which returns when its outputs are on the host), or CUDA events
around a batch of calls (``xpuruntime.pytorch``'s kernels, which return before the
device finishes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Comparison", "compare_calls", "sample", "wall_clock"]


def wall_clock(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes on the host's clock."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sample(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    min_iterations: int = 10,
    max_iterations: int = 1000,
    min_seconds: float = 0.2,
    timer: Callable[[Callable[[], object]], float] = wall_clock,
    on_sample: Callable[[int], None] | None = None,
) -> list[float]:
    """Call ``fn`` ``warmup`` times, then take ``timer(fn)`` samples until both
    ``min_iterations`` samples and ``min_seconds`` have passed (at most
    ``max_iterations``); ``on_sample(n)`` after each."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_iterations and (
        len(samples) < min_iterations or time.perf_counter() - started < min_seconds
    ):
        samples.append(timer(fn))
        if on_sample is not None:
            on_sample(len(samples))
    return samples


@dataclass(frozen=True)
class Comparison:
    """Seconds per call of several callables, timed in the same interleaved rounds.

    ``seconds[name][r]`` is ``name``'s time in round ``r`` (None where it raised a
    RuntimeError: a backend refusing the shape).
    """

    seconds: dict[str, list[float | None]]

    @property
    def medians(self) -> dict[str, float | None]:
        """Median seconds per call over the rounds (None for a callable that refused)."""
        return {
            name: None if None in times else statistics.median(times)  # type: ignore[arg-type]
            for name, times in self.seconds.items()
        }

    def fastest(self, among: list[str] | None = None) -> str:
        """The name with the lowest median (of ``among``, by default of all)."""
        medians = {
            n: m for n, m in self.medians.items() if m is not None and (among is None or n in among)
        }
        return min(medians, key=medians.__getitem__)

    def speed_ratio(self, name: str, anchor: str) -> float:
        """Median over rounds of ``anchor``'s time / ``name``'s time in the same round:
        above 1 when ``name`` is faster. Pairing within a round cancels the drift of a
        device's clock over the run, which comparing separate best or median figures
        does not."""
        pairs = zip(self.seconds[anchor], self.seconds[name], strict=True)
        return statistics.median(a / b for a, b in pairs if a is not None and b is not None)


def compare_calls(
    calls: dict[str, Callable[[], object]],
    measure: Callable[[Callable[[], object]], float],
    *,
    rounds: int = 7,
) -> Comparison:
    """``measure(fn)`` (seconds per call) of each callable in ``rounds`` interleaved
    rounds, in alternating order (A B C, C B A, ...), so that each round compares the
    callables at about the same moment of the run."""
    seconds: dict[str, list[float | None]] = {name: [] for name in calls}
    order = list(calls)
    for round_ in range(rounds):
        for name in order[:: -1 if round_ % 2 else 1]:
            try:
                seconds[name].append(measure(calls[name]))
            except RuntimeError:
                seconds[name].append(None)  # the callable refuses (a backend and a shape)
    return Comparison(seconds)

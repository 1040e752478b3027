"""Timing PyTorch work on its device: CUDA events on a GPU, the wall clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Comparison", "compare_calls", "time_call", "time_training_call"]


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    min_iterations: int = 5,
    min_seconds: float = 0.05,
    max_iterations: int = 200,
    batch_seconds: float = 5e-3,
) -> float:
    """Median seconds per call of ``fn`` on ``device``, after ``warmup`` calls.

    On a GPU, calls are timed in batches of at least ``batch_seconds`` between one pair of
    CUDA events, so that launch gaps and the host synchronisation after each sample do
    not weigh on sub-millisecond kernels; the median is taken over the batches. The
    device idles from the first event until the host has launched the batch's first
    kernel (~0.1 ms for an op with a Python launcher): batches of ~1 ms counted that
    against such ops (measured on an H200: a 0.65 ms layer norm timed at 0.84 ms, so
    auto picked a slower kernel), batches of 5 ms make it a 2% effect.
    """
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    batch = 1
    if cuda:
        torch.cuda.synchronize(device)
        batch = max(1, min(100, round(batch_seconds / max(_cuda_seconds(fn, 1), 1e-7))))
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_iterations and (
        len(samples) < min_iterations or time.perf_counter() - started < min_seconds
    ):
        if cuda:
            samples.append(_cuda_seconds(fn, batch))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_training_call(
    run: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    device: torch.device,
    *,
    backward: bool,
    grad: torch.Tensor | None = None,
) -> float:
    """:func:`time_call` of ``run()`` and, with ``backward``, of the backward of its
    output by ``grad`` (ones when None), the ``leaves``' gradients cleared after each
    call as in training (no accumulation into old gradients)."""

    def step() -> None:
        out = run()
        if backward:
            out.backward(torch.ones_like(out) if grad is None else grad)
            for t in leaves:
                t.grad = None

    with torch.enable_grad() if backward else torch.no_grad():
        return time_call(step, device)


def _cuda_seconds(fn: Callable[[], object], calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / calls


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
        GPU's clock over the run, which comparing separate best or median figures does
        not."""
        pairs = zip(self.seconds[anchor], self.seconds[name], strict=True)
        return statistics.median(a / b for a, b in pairs if a is not None and b is not None)


def compare_calls(
    calls: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int = 7,
    min_seconds: float = 0.2,
) -> Comparison:
    """Time each callable with :func:`time_call` (at least ``min_seconds`` each) in
    ``rounds`` interleaved rounds, in alternating order (A B C, C B A, ...), so that each
    round compares the callables at about the same moment of the run."""
    seconds: dict[str, list[float | None]] = {name: [] for name in calls}
    order = list(calls)
    for round_ in range(rounds):
        for name in order[:: -1 if round_ % 2 else 1]:
            try:
                seconds[name].append(time_call(calls[name], device, min_seconds=min_seconds))
            except RuntimeError:
                seconds[name].append(None)  # the callable refuses (a backend and a shape)
    return Comparison(seconds)

"""``threads='auto'``: the intra-op thread count a CPU engine runs one request fastest
with, measured on the session's sample inputs before the engine is built.

A model that computes for a fraction of a millisecond loses more to waking and joining
threads than it gains from them on many cores: Silero VAD on a 16-core Xeon ran 0.141 ms
a call on OpenVINO's default threads and 0.105-0.116 ms on the one or two threads three
sessions picked, while PP-OCR cls (3 ms) and rec (11 ms) ran fastest at the default or
8, and ONNX Runtime's VAD gained less than the margin from any count.

So the default is timed first; only a model whose call takes less than
:data:`TUNED_BELOW_S` is timed again on 1, 2, 4, ... threads (fewer than the cores), in
interleaved rounds against the default, and the fastest kept where it beats the default
by :data:`MARGIN` in the median round. Under ``performance='throughput'`` the engine's
own split of the cores stands (one thread per request on ONNX Runtime, OpenVINO's
streams).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["MARGIN", "TUNED_BELOW_S", "chosen_threads", "counts_below"]

logger = logging.getLogger("xpuruntime.engines")

TUNED_BELOW_S = 2e-3
"""The default's time a call below which fewer threads are tried."""

MARGIN = 0.10
"""How much faster than the default a thread count must be, in the median round (the
16-core Xeon's own timings of one configuration moved by 5-10% between sessions)."""

Runner = Callable[[int | None], Callable[[], Any]]


def counts_below(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``."""
    counts, count = [], 1
    while count < cores:
        counts.append(count)
        count *= 2
    return counts


def chosen_threads(runner: Runner, cores: int, engine: str) -> tuple[int | None, str]:
    """The thread count to build with (None: the engine's default) and the line that
    says why. ``runner(threads)`` builds the engine's model with that many intra-op
    threads (None: its default) and returns a call that runs the sample inputs once;
    a build or run that fails leaves the default, said why (no sample inputs and an
    input that is not floating point; shapes the model cannot take)."""
    from .._timing import compare_calls, sample

    def per_call(fn: Callable[[], Any]) -> float:
        times = sample(fn, warmup=5, min_iterations=10, max_iterations=1000, min_seconds=0.05)
        return float(np.median(times))

    try:
        default = runner(None)
        alone = per_call(default)
        if alone >= TUNED_BELOW_S:
            return None, (
                f"{engine}'s default (auto: a call takes {alone * 1e3:.3g} ms, long enough "
                "for its threads to pay off)"
            )
        counts = counts_below(cores)
        if not counts:
            return None, f"{engine}'s default (auto: one core)"
        calls = {"default": default, **{str(n): runner(n) for n in counts}}
    except Exception as e:  # measuring is an optimisation: the default stands, said why
        shown = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        logger.info("threads auto: not measured (%s)", shown)
        return None, f"{engine}'s default (auto: not measured: {shown})"
    timed = compare_calls(calls, per_call, rounds=7)
    medians = timed.medians
    if medians["default"] is None:  # it ran before, then failed: nothing to compare with
        return None, f"{engine}'s default (auto: the default's runs failed while timed)"
    ratios = {n: timed.speed_ratio(n, "default") for n in calls if medians[n] is not None}
    best = max((n for n in ratios if n != "default"), key=ratios.__getitem__, default=None)
    shown = "; ".join(f"{n}: {medians[n] * 1e3:.3g} ms" for n in calls if medians[n] is not None)
    if best is None or ratios[best] < 1 + MARGIN:
        line = f"{engine}'s default (auto: no fewer threads ran {1 + MARGIN:.2f}x faster; {shown})"
        chosen = None
    else:
        line = f"{best} (auto: {ratios[best]:.2f}x {engine}'s default; {shown})"
        chosen = int(best)
    logger.info("threads auto: %s", line)
    return chosen, line

"""Dispatcher: the one selection mechanism, for engines and kernels alike.

The policy's preference is tried first; then the auto strategy walks the other
candidates (``first_supported``: the first that supports the call; ``best_performance``:
the fastest, measured once per cache key and remembered on disk, where it beats the
first supported one by more than the measurement's spread and ``AUTO_MARGIN``). Strict mode raises
instead of falling back; a fallback in non-strict mode is logged and warned once per
(op, requested, reason, outcome), never silent.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._errors import (
    BackendUnavailableError,
    ModelLoadError,
    PolicyError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from ..policies._choices import choose_strategy
from ..runtime._profiler import Profiler
from ._decision import Decision, Support
from ._dispatch_log import DispatchLog
from ._measurements import MeasurementCache
from ._registry import KernelRegistry

__all__ = ["Dispatcher", "FallbackWarning"]

logger = logging.getLogger("xpuruntime.dispatch")

MEASURE_ROUNDS = 4
"""How many interleaved rounds ``best_performance`` measures each candidate for."""

AUTO_MARGIN = 0.05
"""How much faster than the default (the first supported candidate) another candidate
must measure for ``best_performance`` to choose it, at least: an op timed alone ranks
kernels within a few percent of how they rank inside a training step, not better."""

NOISY_SPREAD = 0.5
"""A spread (relative) over which a default kept for it is measured again."""

NOISY_REMEASURES = 2
"""How many more sets of MEASURE_ROUNDS a too noisy measurement gets."""


class FallbackWarning(UserWarning):
    """A policy's choice could not be honoured and another candidate runs instead."""


class Dispatcher:
    """Chooses a candidate per op from a :class:`KernelRegistry` and records why.

    Parameters
    ----------
    registry : KernelRegistry
        Where the candidates come from.
    log : DispatchLog, optional
        Where decisions are recorded when logging is enabled.
    """

    def __init__(self, registry: KernelRegistry, log: DispatchLog | None = None) -> None:
        self._registry = registry
        self._log = log if log is not None else DispatchLog()
        self._warned: set[tuple[str, ...]] = set()
        self._warned_lock = threading.Lock()
        self.consensus: Callable[[str, tuple], tuple] | None = None
        """Set in a distributed job (``xpuruntime.pytorch.distributed``): takes an op and
        this process's ``best_performance`` result ``(chosen, reason, timings)`` and
        returns rank 0's, so that every rank runs the same kernel."""
        self.strict = False
        """Whether the kernel policy in force is strict (set by ``xpuruntime.pytorch``'s
        policy state): a direct call of one of our ops that cannot run its kernel then
        raises instead of falling back to PyTorch's op."""

    @property
    def registry(self) -> KernelRegistry:
        return self._registry

    @property
    def log(self) -> DispatchLog:
        return self._log

    def select(
        self,
        op: str,
        ctx: Any,
        *,
        requested: str | None = None,
        strategy: str = "first_supported",
        strict: bool = False,
        order: list[str] | None = None,
        accept: Callable[[Any], Support] | None = None,
        measure: Callable[[Any], float] | None = None,
        cache: MeasurementCache | None = None,
        cache_key: str | None = None,
    ) -> Decision:
        """Choose a candidate for ``op`` and return the :class:`Decision`.

        Parameters
        ----------
        op : str
            The op whose candidates are considered.
        ctx : object
            Passed to each candidate's ``supports(ctx)``; its ``summary`` attribute (a
            dict), if any, goes into the dispatch log.
        requested : str, optional
            The policy's choice; None or ``'auto'`` leaves it to ``strategy``.
        strategy : {'first_supported', 'best_performance'}
        strict : bool
            Raise instead of falling back when ``requested`` cannot run.
        order : list of str, optional
            Auto preference order (default: registration order). Candidates not listed
            are not considered.
        accept : callable, optional
            A second, costlier check run on a supported candidate before it is chosen
            (building it, gating its accuracy); a ``Support.no`` rejects it.
        measure : callable, optional
            Seconds per run of a candidate; required for ``best_performance``.
        cache, cache_key : optional
            Where ``best_performance`` timings are remembered.

        Raises
        ------
        PolicyError
            ``requested`` or ``strategy`` is not a valid choice.
        UnsupportedOperationError
            Nothing can run, or (strict) ``requested`` cannot; lists the reasons.
        """
        started = time.perf_counter()
        strategy = choose_strategy(strategy)
        registered = self._registry.names(op)
        if not registered:
            raise UnsupportedOperationError(f"{op}: no candidates are registered")
        if requested == "auto":
            requested = None
        if requested is not None and requested not in registered:
            raise PolicyError(
                f"{op}: {requested!r} is not a registered choice; "
                f"expected one of {[*registered, 'auto']}"
            )
        run = _Selection(self._registry, op, ctx, accept)
        chosen = None
        if requested is not None:
            support = run.check(requested)
            if support.ok:
                chosen = (requested, "policy", f"the policy asks for it; {support.reason}", {})
            elif strict and support.missing_backend:
                raise BackendUnavailableError(
                    f"{op}: the policy asks for {requested!r}: {support.reason}"
                )
            elif strict and isinstance(support.error, (ModelLoadError, UnsupportedOperationError)):
                raise support.error
            elif strict:
                raise UnsupportedOperationError(
                    f"{op}: the policy asks for {requested!r}, which cannot run here: "
                    f"{support.reason} (strict mode, so no fallback)",
                    tuple(run.rejected),
                )
        if chosen is None:
            pool = [n for n in (registered if order is None else order) if n != requested]
            source = "auto" if requested is None else "fallback"
            if strategy == "first_supported":
                found = run.first_supported(pool)
            else:
                found = run.fastest(pool, measure, cache, cache_key)
                if self.consensus is not None:
                    found = self._agree(op, run, found)
            chosen = (found[0], source, found[1], found[2])
        name, source, reason, timings = chosen
        decision = Decision(
            op=op,
            chosen=name,
            source=source,
            reason=reason,
            requested=requested,
            strategy=strategy,
            candidates=tuple(run.considered),
            rejected=tuple(run.rejected),
            measurements=timings,
        )
        self._report(decision, ctx, time.perf_counter() - started)
        return decision

    def _agree(self, op: str, run: _Selection, found: tuple) -> tuple:
        """Rank 0's measured choice, on every process of a distributed job."""
        chosen, reason, timings = self.consensus(op, found)
        if chosen != found[0] and chosen not in run.considered and not run.check(chosen).ok:
            raise UnsupportedOperationError(
                f"{op}: rank 0 measured {chosen!r} fastest, which cannot run on this rank: "
                f"{dict(run.rejected).get(chosen, '')}",
                tuple(run.rejected),
            )
        return chosen, reason, timings

    def forget_warnings(self) -> None:
        """Warn again about fallbacks already warned about (each is warned once)."""
        with self._warned_lock:
            self._warned.clear()

    # -- reporting ------------------------------------------------------------------------
    def _report(self, decision: Decision, ctx: Any, elapsed: float) -> None:
        logger.info(
            "%s -> %s (%s): %s", decision.op, decision.chosen, decision.source, decision.reason
        )
        if decision.source == "fallback":
            reason = dict(decision.rejected).get(decision.requested or "", "")
            key = (decision.op, decision.requested or "", reason, decision.chosen, decision.reason)
            with self._warned_lock:
                first = key not in self._warned
                self._warned.add(key)
            message = (
                f"{decision.op}: the policy asks for {decision.requested!r}, which cannot "
                f"run here ({reason}); falling back to {decision.chosen!r} "
                f"({decision.reason}). "
                "Use strict=True to make this an error."
            )
            logger.warning(message)
            if first:
                warnings.warn(message, FallbackWarning, stacklevel=4)
        self._log.record(decision, getattr(ctx, "summary", None), elapsed)
        profiler = Profiler.instance()
        if profiler.enabled:
            profiler.instant(
                f"decide {decision.op}: {decision.chosen}",
                "dispatch",
                source=decision.source,
                reason=decision.reason,
                elapsed_ms=elapsed * 1e3,
            )


def _ask(fn: Callable[[Any], Support], arg: Any) -> Support:
    """Call a supports/accept check; an xpuruntime error becomes a rejection reason."""
    try:
        answer = fn(arg)
    except XpuRuntimeError as e:
        return Support(False, f"{type(e).__name__}: {e}", isinstance(e, BackendUnavailableError), e)
    if not isinstance(answer, Support):
        raise TypeError(f"{fn!r} returned {answer!r}, expected a Support")
    return answer


class _Selection:
    """One select() call's working state: what was considered and why it was rejected."""

    def __init__(self, registry: KernelRegistry, op: str, ctx: Any, accept) -> None:
        self.registry, self.op, self.ctx = registry, op, ctx
        self.accept = accept or (lambda candidate: Support.yes())
        self.considered: list[str] = []
        self.rejected: list[tuple[str, str]] = []
        self.errors: list[XpuRuntimeError] = []

    def check(self, name: str) -> Support:
        candidate = self.registry.get(self.op, name)
        self.considered.append(name)
        support = _ask(candidate.supports, self.ctx)
        if support.ok:
            support = _ask(self.accept, candidate)
        if not support.ok:
            self.rejected.append((name, support.reason))
            if support.error is not None:
                self.errors.append(support.error)
        return support

    def first_supported(self, pool: list[str]) -> tuple[str, str, dict[str, float]]:
        for name in pool:
            support = self.check(name)
            if support.ok:
                return name, f"first supported candidate; {support.reason}", {}
        raise self.nothing_runs()

    def fastest(self, pool, measure, cache, cache_key) -> tuple[str, str, dict[str, float]]:
        if measure is None:
            raise PolicyError(f"{self.op}: best_performance needs a way to measure candidates")
        stored = cache.get(cache_key) if cache is not None and cache_key else None
        if stored:
            # Only the remembered winner is built and checked; the rest stay untouched.
            spreads = cache.spreads(cache_key)
            remembered = [n for n in pool if n in stored]
            while remembered:
                name, why = _winner(remembered, stored, spreads)
                if self.check(name).ok:
                    timings = {n: stored[n] for n in pool if n in stored}
                    return name, f"{why} (cached): {_ms(timings)}", timings
                remembered.remove(name)
        supported = [name for name in pool if name not in self.considered and self.check(name).ok]
        # Candidates are measured in MEASURE_ROUNDS interleaved rounds in alternating
        # order (A, B, B, A, A, B) and keep their best round, so that neither a burst of
        # load nor a device clocking down under sustained work decides the comparison.
        # A default kept only because the rounds lie far apart (a busy machine) is
        # measured again, up to NOISY_REMEASURES times, rather than decided by the noise.
        rounds: dict[str, list[float]] = {}
        unmeasured: dict[str, str] = {}
        for round_ in range(MEASURE_ROUNDS * (1 + NOISY_REMEASURES)):
            if round_ and round_ % MEASURE_ROUNDS == 0 and not _too_noisy(rounds, supported):
                break
            for name in supported[:: -1 if round_ % 2 else 1]:
                if name in unmeasured:
                    continue
                try:
                    seconds = float(measure(self.registry.get(self.op, name)))
                except XpuRuntimeError as e:
                    unmeasured[name] = str(e).splitlines()[0][:300]
                    rounds.pop(name, None)
                    continue
                rounds.setdefault(name, []).append(seconds)
        skipped = "; ".join(f"{n}: timing run failed ({r})" for n, r in unmeasured.items())
        if not rounds:
            if not supported:
                raise self.nothing_runs()
            # A timing run can fail on inputs generated from metadata (dims of 1, random
            # integers) where real inputs work: that says nothing about the candidate.
            return (
                supported[0],
                f"first supported candidate: no timing run succeeded ({skipped}); pass "
                "sample_inputs to measure on real inputs",
                {},
            )
        timings = {name: min(times) for name, times in rounds.items()}
        spreads = {name: _spread(times) for name, times in rounds.items()}
        if cache is not None and cache_key:
            cache.put(cache_key, timings, spreads)
        best, why = _winner([n for n in supported if n in timings], timings, spreads)
        note = f"; skipped {skipped}; pass sample_inputs to measure them" if skipped else ""
        return best, f"{why}: {_ms(timings)}{note}", timings

    def nothing_runs(self) -> XpuRuntimeError:
        """The error for "nothing can run": a ``ModelLoadError`` when every candidate
        failed to load the model, chained to the first backend exception."""
        reasons = "; ".join(f"{n}: {r}" for n, r in self.rejected) or "no candidates"
        message = f"{self.op}: no candidate can run this ({reasons})"
        loads = [e for e in self.errors if isinstance(e, ModelLoadError)]
        if loads and len(loads) == len(self.rejected):
            error: XpuRuntimeError = ModelLoadError(message)
        else:
            error = UnsupportedOperationError(message, tuple(self.rejected))
        error.__cause__ = self.errors[0] if self.errors else None
        return error


def _too_noisy(rounds: dict[str, list[float]], supported: list[str]) -> bool:
    """Whether the rounds so far keep the default only for their spread: another
    candidate ran faster than the margin asks, but within a spread over
    :data:`NOISY_SPREAD`."""
    order = [n for n in supported if n in rounds]
    if len(order) < 2:
        return False
    timings = {name: min(times) for name, times in rounds.items()}
    spreads = {name: _spread(times) for name, times in rounds.items()}
    best, _ = _winner(order, timings, spreads)
    fastest = min(order, key=timings.__getitem__)
    return (
        best == order[0] != fastest
        and timings[order[0]] / timings[fastest] > 1 + AUTO_MARGIN
        and max(spreads[fastest], spreads[order[0]]) > NOISY_SPREAD
    )


def _spread(times: list[float]) -> float:
    """How far a candidate's best two rounds lie apart, relative to the best: what its
    best round (the figure compared) is trusted to."""
    best, *rest = sorted(times)
    return (rest[0] - best) / best if rest and best > 0 else 0.0


def _winner(
    order: list[str], timings: dict[str, float], spreads: dict[str, float]
) -> tuple[str, str]:
    """The measured choice and why: the first in ``order`` (what ``first_supported``
    picks, the default) unless another is faster by more than ``AUTO_MARGIN`` and more
    than either's spread, so that a measured choice never loses to the default by noise."""
    default = order[0]
    fastest = min(order, key=timings.__getitem__)
    if fastest == default:
        return default, "fastest when measured"
    # Speed-up and spread in one unit (how much longer the slower time is, relative to
    # the faster): a time saved (at most 100%) against a spread (unbounded, over 100% on
    # a loaded machine) would refuse even a kernel 1000 times faster.
    speedup = timings[default] / timings[fastest]
    needed = 1.0 + max(AUTO_MARGIN, spreads.get(fastest, 0.0), spreads.get(default, 0.0))
    if speedup > needed:
        return fastest, (
            f"fastest when measured, {speedup:.2f}x the speed of the default {default} "
            f"(needed {needed:.2f}x)"
        )
    return default, (
        f"the default, kept: {fastest} ran {speedup:.2f}x its speed, within the "
        f"{needed:.2f}x a measured choice must reach"
    )


def _ms(timings: dict[str, float]) -> str:
    ordered = sorted(timings.items(), key=lambda item: item[1])
    return ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in ordered)

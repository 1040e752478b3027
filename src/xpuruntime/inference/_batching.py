"""Requests joined into batches: how ``InferenceSession.run_many`` keeps an engine busy
when one Python call per input costs more than the input's compute.

Silero VAD computes a 36 ms chunk of audio in about 60 µs on one core, and OpenVINO's
``benchmark_app`` runs 74k of them a second on a 16-core Xeon; one Python call per input
(validation, tensors, a handoff between threads) allowed a tenth of that. Joined along
the model's batch axis, 64 inputs cost one call, and the engine computes them in one
pass (VAD on a 2-vCPU VM: 6.5 µs an input in a batch of 32, 78 alone).

Which axis, per input: the first whose declared dimension is symbolic, unknown (None, or
-1 as Paddle exports) or 1
(VAD's ``input`` [1, 576] joins on 0, its LSTM ``state`` [2, 1, 128] on 1). An input with
none (a scalar sample rate) is not joined: a batch holds inputs that agree on it.

Whether that is right is checked, not assumed: per input signature (shapes, dtypes, the
values not joined), the first batch's inputs also run alone, and the batch is trusted
only if every output, split where it grew, equals their outputs within rounding (a
model that mixes rows, reshapes the batch away or cannot run the batch's shape runs
every input alone from then on; ``decisions`` says why). The check needs inputs that
differ: a batch of identical inputs is run alone and the check waits for the next.

How many, under ``request_batch='auto'``: none where an input alone computes for longer
than Python takes to feed the requests in flight (``PER_REQUEST_S`` each), since joining
then only changes how the engine spreads its work (PP-OCR cls on the Xeon: 0.41-0.74x
``benchmark_app`` in batches of 4, 0.76x alone); else enough that a batch computes for
``HIDDEN`` times that Python time (at most ``MAX_JOINED`` inputs and
``MAX_BATCH_BYTES``), from the first inputs' time alone; none under
``performance='latency'``.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import XpuRuntimeError
from .._model import TensorSpec

__all__ = ["Alone", "Batched", "RequestBatcher", "batch_axes", "outputs_agree", "same_inputs"]

logger = logging.getLogger("xpuruntime.inference")

# What a request costs the Python threads that feed the engine (validation, tensors,
# handoffs between threads), held under one interpreter lock: 27 µs on an idle 2-vCPU
# VM, about 190 µs on the 16-core Xeon with 16 requests in flight (Silero VAD run alone:
# 5.2k results/s).
PER_REQUEST_S = 200e-6
# How many times that Python time a batch computes for: Silero VAD on the Xeon (16
# requests, 0.5 ms an input alone) reached 0.46x benchmark_app in batches of 16, 0.79x
# of 32 and 0.98x of 64.
HIDDEN = 8
MAX_JOINED = 64
MAX_BATCH_BYTES = 64 << 20
TIMED = 5  # inputs run alone to time one (the first may compile a shape)

# rel_l2 of each input's outputs in the batch against its outputs alone: rounding (a
# kernel blocked for another batch size sums in another order) passes, mixed rows do not.
_TOLERANCE = {"fp32": 1e-4, "reduced": 1e-2}

Feeds = dict[str, np.ndarray]


def batch_axes(specs: Sequence[TensorSpec]) -> dict[str, int | None] | None:
    """Per input, the axis requests join on (None: not joined, must agree), or None when
    no input has one."""
    axes: dict[str, int | None] = {}
    for spec in specs:
        if spec.shape is None:
            return None  # rank unknown: no axis to name
        axes[spec.name] = next(
            (a for a, d in enumerate(spec.shape) if not isinstance(d, int) or d < 2), None
        )
    return axes if any(a is not None for a in axes.values()) else None


@dataclass(frozen=True)
class Alone:
    """One input to run by itself; ``outputs`` set when it already ran; ``valid`` False
    for one that failed validation (validated again where it runs, to raise there)."""

    feeds: Feeds
    outputs: list[np.ndarray] | None = None
    valid: bool = True


@dataclass(frozen=True)
class Batched:
    """``size`` inputs joined into ``feeds`` along ``input_axes``; each output splits
    along its axis of ``output_axes``."""

    feeds: Feeds
    size: int
    input_axes: dict[str, int | None]
    output_axes: tuple[int, ...]

    def split(self, outputs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Each input's outputs, in order: contiguous views of one copy per output (a
        split along another axis than the first is moved to the front once)."""
        parts = [_parts(o, self.size, a) for o, a in zip(outputs, self.output_axes)]
        return [list(row) for row in zip(*parts)]

    def rows(self) -> list[Feeds]:
        """The inputs it joins, each as fed alone."""
        return _rows(self.feeds, self.size, self.input_axes)


@dataclass(frozen=True)
class _Trusted:
    size: int
    output_axes: tuple[int, ...]


class RequestBatcher:
    """What ``run_many`` joins, decided per input signature and kept for the session.

    Parameters
    ----------
    specs
        The model's inputs.
    setting
        The policy's ``request_batch``: ``'auto'`` or how many inputs a batch joins.
    throughput
        Whether the policy's performance is ``'throughput'`` (``'auto'`` joins only then).
    reduced
        Whether the engine computes below fp32 anywhere (bf16, fp16, an int8 model's
        bf16 rest): its batches may round further from its inputs alone.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        setting: int | str,
        *,
        throughput: bool,
        reduced: bool,
    ) -> None:
        self._axes = batch_axes(specs)
        self._setting = setting
        self._tolerance = _TOLERANCE["reduced" if reduced else "fp32"]
        # Per signature: the times of its first inputs alone ('auto', being sized), the
        # size its first batch will be checked at, _Trusted, or why its inputs run alone.
        self._state: dict[tuple, list[float] | int | _Trusted | str] = {}
        self._lock = threading.Lock()
        if setting == 1:
            self._off = "request_batch=1"
        elif setting == "auto" and not throughput:
            self._off = "performance='latency' (request_batch='auto' joins under 'throughput')"
        elif self._axes is None:
            self._off = "no input has a batch axis (a dimension declared symbolic or 1)"
        else:
            self._off = None

    @property
    def decisions(self) -> list[str]:
        """How the inputs of each signature seen run, for ``explain()``."""
        if self._off is not None:
            return [f"every input alone: {self._off}"]
        with self._lock:
            decided = [(k, v) for k, v in self._state.items() if isinstance(v, (_Trusted, str))]
        lines = []
        for key, verdict in decided:
            shown = " ".join(f"{name}={'x'.join(map(str, shape))}" for name, shape, _ in key[0])
            if isinstance(verdict, _Trusted):
                lines.append(f"{shown}: {verdict.size} inputs a batch (checked against alone)")
            else:
                lines.append(f"{shown}: alone ({verdict})")
        return lines

    def requests(
        self,
        inputs: Iterable[Any],
        validate: Callable[[Any], Feeds],
        run: Callable[[Feeds], list[np.ndarray]],
        run_batch: Callable[[Feeds], list[np.ndarray]],
        requests: Callable[[], int],
        copy: bool = True,
    ) -> Iterator[Alone | Batched]:
        """``inputs`` as the requests to run, in order: consecutive inputs of one
        signature joined where trusted; the runs that decide (timing, the check) are
        made here, on ``run`` and ``run_batch``.

        Every input is copied as it is read (the caller may reuse its buffers), unless
        ``copy`` is False (an input run alone is then read in place; a joined one is
        still copied into its batch); one that fails validation is yielded alone, after
        the inputs before it, so that its run raises its error at its turn.
        """
        own = _copied if copy else _as_given
        gathering: _Gathering | None = None
        for item in inputs:
            try:
                feeds = validate(item)
            except XpuRuntimeError:
                if gathering is not None:
                    yield from gathering.alone()
                gathering = None
                yield Alone(item, valid=False)
                continue
            key = None if self._off is not None else _signature(feeds, self._axes)
            state = None if key is None else self._state_of(key)
            if gathering is not None and gathering.key != key:
                yield from gathering.alone()
                gathering = None
            if not isinstance(state, (int, _Trusted)):  # alone, or timed alone
                if isinstance(state, list) and len(state) < TIMED:
                    feeds = own(feeds)
                    started = time.perf_counter()
                    outputs = _outputs(run, feeds)
                    if outputs is not None:
                        self._timed(key, feeds, time.perf_counter() - started, requests())
                    yield Alone(feeds, outputs)
                else:
                    yield Alone(own(feeds))
                continue
            size = state if isinstance(state, int) else state.size
            if gathering is None:
                gathering = _Gathering(key, feeds, size, self._axes)
            if not gathering.add(feeds):
                continue
            batch, gathering = gathering, None
            if isinstance(state, _Trusted):
                yield Batched(batch.feeds, size, self._axes, state.output_axes)
            else:
                yield from self._checked(key, batch.feeds, size, run, run_batch)
        if gathering is not None:
            yield from gathering.alone()

    def _state_of(self, key: tuple) -> list[float] | int | _Trusted | str:
        with self._lock:
            state = self._state.get(key)
            if state is None:
                auto = self._setting == "auto"
                state = self._state[key] = [] if auto else self._setting
            return state

    def _timed(self, key: tuple, feeds: Feeds, seconds: float, requests: int) -> None:
        """Note one input's time alone; after ``TIMED`` (``'auto'``), size the batches
        of ``key`` from the fastest but the first."""
        with self._lock:
            times = self._state[key]
            if not isinstance(times, list) or len(times) >= TIMED:
                return
            times.append(seconds)
            if len(times) < TIMED:
                return
            fastest = max(min(times[1:]), 1e-9)
            feeding = requests * PER_REQUEST_S  # Python's time to feed the requests in flight
            wanted = math.ceil(HIDDEN * feeding / fastest)
            nbytes = max(1, sum(v.nbytes for v in feeds.values()))
            size = min(1 << max(0, wanted - 1).bit_length(), MAX_JOINED, MAX_BATCH_BYTES // nbytes)
            if fastest >= feeding or size < 2:
                self._state[key] = (
                    f"an input computes for {fastest * 1e3:.3g} ms alone, longer than Python "
                    f"takes to feed {requests} request(s)"
                )
            else:
                self._state[key] = size

    def _checked(
        self,
        key: tuple,
        batch: Feeds,
        size: int,
        run: Callable[[Feeds], list[np.ndarray]],
        run_batch: Callable[[Feeds], list[np.ndarray]],
    ) -> Iterator[Alone]:
        """The first batch of ``key``: its inputs run alone (their outputs are the
        results) and joined; the batch is trusted if they agree."""
        rows = _rows(batch, size, self._axes)
        alone = [_outputs(run, feeds) for feeds in rows]
        yield from (Alone(feeds, outputs) for feeds, outputs in zip(rows, alone))
        if any(outputs is None for outputs in alone):
            return  # an input failed alone (it fails again at its turn): the next decides
        if all(same_inputs(rows[0], feeds) for feeds in rows[1:]):
            return  # identical inputs cannot show rows mixed: the next batch decides
        try:
            verdict: _Trusted | str = self._agreement(alone, run_batch(batch), size)
        except XpuRuntimeError as e:
            verdict = f"the engine cannot run the batch: {str(e).strip().splitlines()[0]}"
        if isinstance(verdict, _Trusted):
            logger.info("run_many joins %d inputs of %s a batch", size, key[0])
        else:
            logger.warning("run_many runs inputs of %s alone: %s", key[0], verdict)
        with self._lock:
            self._state[key] = verdict

    def _agreement(
        self, alone: list[list[np.ndarray]], joined: list[np.ndarray], size: int
    ) -> _Trusted | str:
        """How the joined outputs split into the outputs alone, or why they do not."""
        axes = []
        for index, output in enumerate(joined):
            each = [outputs[index] for outputs in alone]
            if any(o.shape != each[0].shape or o.dtype != each[0].dtype for o in each):
                return f"output {index}'s shape or type differs between inputs"
            axis = next(
                (
                    a
                    for a in _grown_axes(each[0].shape, output.shape, size)
                    if outputs_agree(_parts(output, size, a), each, self._tolerance)
                ),
                None,
            )
            if axis is None:
                return (
                    f"output {index} of the batch ({'x'.join(map(str, output.shape))}) is "
                    f"not its inputs' outputs alone ({'x'.join(map(str, each[0].shape))} "
                    f"each) joined within rel_l2 {self._tolerance:g}"
                )
            axes.append(axis)
        return _Trusted(size, tuple(axes))

    @property
    def tolerance(self) -> float:
        """The rel_l2 a joined input's outputs may differ from its outputs alone by."""
        return self._tolerance


def outputs_agree(parts: list[np.ndarray], alone: list[np.ndarray], tolerance: float) -> bool:
    """Whether each of ``parts`` (an input's outputs cut from a batch's) is its output
    ``alone``: same dtype, integers and non-finite values equal, floats within rel_l2
    ``tolerance``."""
    for part, expected in zip(parts, alone, strict=True):
        if part.dtype != expected.dtype or part.shape != expected.shape:
            return False
        if expected.dtype.kind not in "fc":
            if not np.array_equal(part, expected):
                return False
            continue
        both = np.isfinite(expected)
        if not np.array_equal(both, np.isfinite(part)) or not np.array_equal(
            part[~both], expected[~both], equal_nan=True
        ):
            return False
        wanted = np.asarray(expected[both], np.float64)
        error = np.linalg.norm(np.asarray(part[both], np.float64) - wanted)
        if error > tolerance * max(np.linalg.norm(wanted), 1e-30):
            return False
    return True


def _outputs(run: Callable[[Feeds], list[np.ndarray]], feeds: Feeds) -> list[np.ndarray] | None:
    """``feeds``' outputs, or None where the run fails: run again where results are
    yielded, its error is raised at its turn, after the results before it."""
    try:
        return run(feeds)
    except XpuRuntimeError:
        return None


class _Gathering:
    """Inputs of one signature being joined: each copied into its place in the batch as
    it is read."""

    def __init__(self, key: tuple, first: Feeds, size: int, axes: dict[str, int | None]):
        self.key, self._size, self._axes, self._count = key, size, axes, 0
        self.feeds: Feeds = {}
        self._places = []  # (name, batch array, the index of each input's place in it)
        for name, value in first.items():
            axis = axes[name]
            if axis is None:
                self.feeds[name] = np.array(value, copy=True)
                continue
            shape = list(value.shape)
            shape[axis] *= size
            self.feeds[name] = batch = np.empty(shape, value.dtype)
            places = _places(value.ndim, axis, value.shape[axis], size)
            self._places.append((name, batch, places))

    def add(self, feeds: Feeds) -> bool:
        """Copy ``feeds`` in; whether the batch is full."""
        count = self._count
        for name, batch, places in self._places:
            batch[places[count]] = feeds[name]
        self._count = count + 1
        return self._count == self._size

    def alone(self) -> Iterator[Alone]:
        """The inputs gathered so far, each to run alone (the batch will not fill)."""
        rows = _rows(self.feeds, self._size, self._axes)[: self._count]
        return (Alone(feeds) for feeds in rows)


@functools.lru_cache(maxsize=64)
def _places(ndim: int, axis: int, step: int, size: int) -> tuple[tuple[slice, ...], ...]:
    """The index of each of ``size`` inputs' places along ``axis`` of a batch."""
    before = (slice(None),) * axis
    return tuple((*before, slice(i * step, (i + 1) * step)) for i in range(size))


def _parts(output: np.ndarray, size: int, axis: int) -> list[np.ndarray]:
    """``output`` cut into ``size`` equal contiguous parts along ``axis``."""
    step = output.shape[axis] // size
    output = np.ascontiguousarray(output)
    if axis == 0:
        return [output[i * step : (i + 1) * step] for i in range(size)]
    shape = output.shape
    cut = output.reshape((*shape[:axis], size, step, *shape[axis + 1 :]))
    return list(np.ascontiguousarray(np.moveaxis(cut, axis, 0)))


def _as_given(feeds: Feeds) -> Feeds:
    return feeds


def _copied(feeds: Feeds) -> Feeds:
    return {
        name: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
        for name, value in feeds.items()
    }


def _signature(feeds: Feeds, axes: dict[str, int | None]) -> tuple | None:
    """What inputs must share to be joined: the shapes and dtypes of those joined, the
    values of those not (at most 64 elements; None for larger or non-array inputs)."""
    joined, shared = [], []
    for name, value in feeds.items():
        if type(value) is not np.ndarray:
            return None
        if axes[name] is None:
            if value.size > 64:
                return None
            shared.append((name, value.dtype.str, value.shape, value.tobytes()))
        else:
            joined.append((name, value.shape, value.dtype.str))
    return tuple(joined), tuple(shared)


def _rows(batch: Feeds, size: int, axes: dict[str, int | None]) -> list[Feeds]:
    """The ``size`` inputs ``batch`` joins, each as fed alone."""
    parts = {
        name: None if axes[name] is None else _parts(value, size, axes[name])
        for name, value in batch.items()
    }
    return [
        {name: batch[name] if cut is None else cut[i] for name, cut in parts.items()}
        for i in range(size)
    ]


def same_inputs(a: Feeds, b: Feeds) -> bool:
    """Whether two inputs hold equal arrays (identical inputs cannot show rows mixed)."""
    return all(np.array_equal(a[name], b[name]) for name in a)


def _grown_axes(alone: tuple[int, ...], joined: tuple[int, ...], size: int) -> list[int]:
    """The axes along which ``joined`` is ``size`` of ``alone`` end to end."""
    if len(alone) != len(joined):
        return []
    return [
        a
        for a in range(len(alone))
        if joined[a] == alone[a] * size
        and all(joined[b] == alone[b] for b in range(len(alone)) if b != a)
    ]

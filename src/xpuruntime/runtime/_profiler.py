"""The Profiler: named ranges from every layer of xpuruntime, in one Chrome trace.

Sessions (load, engine build, run), the Dispatcher (every decision) and user code push
ranges into the process-wide :class:`Profiler`. Ranges are timed on the host; a range
given a CUDA stream is also timed on the device with a pair of events. The trace opens
in Perfetto (ui.perfetto.dev) and ``chrome://tracing``. When an NVTX tool such as
Nsight Systems profiles the process and the ``nvtx`` package is installed, ranges are
NVTX ranges too (see :func:`load_nvtx`).

Disabled (the default), a range costs one attribute check, plus an NVTX push/pop while
an NVTX tool listens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from .._errors import InvalidInputError
from .._files import atomic_write_text

__all__ = ["Profiler"]


def load_nvtx() -> Any:
    """The ``nvtx`` module when it is installed and an NVTX tool is attached; else None.

    Tools attach to NVTX through the ``NVTX_INJECTION64_PATH`` environment variable,
    which Nsight Systems and Nsight Compute set in the processes they profile. Without a
    tool NVTX records nothing, yet a push and pop still cost ~0.7 µs from Python on
    every range, so none are emitted then (NVTX.jl makes the same choice).
    """
    if not os.environ.get("NVTX_INJECTION64_PATH"):
        return None
    if importlib.util.find_spec("nvtx") is None:  # optional, never required
        return None
    import nvtx

    return nvtx


class Profiler:
    """Process-wide collector of named, timed ranges and instant events.

    Use :meth:`instance`. Ranges nest per thread; each thread is its own track.

    Examples
    --------
    >>> prof = xrt.Profiler.instance()
    >>> prof.enable()
    >>> with prof.range("preprocess", batch=8):
    ...     pass
    >>> prof.push_range("model"); prof.pop_range()
    >>> path = prof.export_chrome_trace("trace.json")       # doctest: +SKIP
    >>> prof.disable(); prof.clear()
    """

    _instance: ClassVar[Profiler | None] = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._device_spans: list[tuple[dict[str, Any], Any, Any]] = []
        self._local = threading.local()
        self._origin_ns = time.perf_counter_ns()
        self._nvtx = load_nvtx()
        self._mirror: Any = None
        self.recording = self._nvtx is not None
        """Whether a range opened now is kept anywhere (recording on, NVTX, or a
        mirror); hot paths read this one attribute and skip their ranges when False."""

    @classmethod
    def instance(cls) -> Profiler:
        """The process-wide profiler."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    # -- switches -----------------------------------------------------------------------
    def enable(self) -> None:
        """Start recording (ranges already open are not recorded)."""
        self.enabled = True
        self._update_recording()

    def disable(self) -> None:
        """Stop recording; what was recorded stays until :meth:`clear`."""
        self.enabled = False
        self._update_recording()

    def mirror_ranges(self, opener: Any) -> Any:
        """Also open every range through ``opener(name)``, a context-manager factory
        (``torch.profiler.record_function`` while an ``xpuruntime.pytorch.profile``
        block runs, so that these ranges show in PyTorch's trace); None stops.
        Returns the previous opener."""
        previous, self._mirror = self._mirror, opener
        self._update_recording()
        return previous

    def _update_recording(self) -> None:
        self.recording = self.enabled or self._nvtx is not None or self._mirror is not None

    def clear(self) -> None:
        """Forget everything recorded."""
        with self._lock:
            self._events.clear()
            self._device_spans.clear()

    @property
    def nvtx(self) -> bool:
        """Whether ranges are also NVTX ranges (an NVTX tool is attached and the ``nvtx``
        package is installed)."""
        return self._nvtx is not None

    # -- recording -------------------------------------------------------------------------
    def push_range(self, name: str, category: str = "user", **args: Any) -> None:
        """Open a range named ``name`` on this thread; :meth:`pop_range` closes it."""
        if self._nvtx is not None:
            self._nvtx.push_range(name, domain="xpuruntime")
        mirrored = None
        if self._mirror is not None:
            mirrored = self._mirror(name)
            mirrored.__enter__()
        stack = self._stack()
        stack.append((name, category, args, time.perf_counter_ns(), self.enabled, mirrored))

    def pop_range(self) -> float:
        """Close this thread's innermost range; returns its host duration in ms.

        Raises
        ------
        InvalidInputError
            When this thread has no open range.
        """
        stack = self._stack()
        if not stack:
            raise InvalidInputError("pop_range: no range is open on this thread")
        end = time.perf_counter_ns()
        name, category, args, start, recording, mirrored = stack.pop()
        if mirrored is not None:
            mirrored.__exit__(None, None, None)
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="xpuruntime")
        if recording:
            self._add(self._complete(name, category, start, end, args))
        return (end - start) / 1e6

    @contextlib.contextmanager
    def range(
        self, name: str, category: str = "user", *, stream: Any = None, **args: Any
    ) -> Iterator[None]:
        """A range around the block.

        Parameters
        ----------
        name, category : str
            Shown in the trace; ``category`` groups ranges (``session``, ``dispatch``...).
        stream : Stream or torch/CuPy stream, optional
            Also time the block's work on this CUDA stream with two events; the device
            span is a track of its own in the trace.
        **args
            Shown with the range in the trace (JSON-serialisable values).
        """
        if not self.recording:
            yield
            return
        events = None
        if stream is not None and self.enabled:
            from ._stream import Event, Stream

            stream = stream if isinstance(stream, Stream) else Stream.wrap(stream)
            events = (Event(stream.device).record(stream), Event(stream.device), stream)
        self.push_range(name, category, **args)
        try:
            yield
        finally:
            if events is not None:
                start, end, stream = events
                end.record(stream)
                span = self._complete(
                    name, category, self._stack()[-1][3], time.perf_counter_ns(), args
                )
                span["pid"], span["tid"] = "cuda", f"{stream.device} stream {stream.handle:#x}"
                with self._lock:
                    self._device_spans.append((span, start, end))
            self.pop_range()

    def instant(self, name: str, category: str = "user", **args: Any) -> None:
        """Record a point event (a decision, a cache hit) on this thread's track."""
        if not self.enabled:
            return
        self._add(
            {
                "name": name,
                "cat": category,
                "ph": "i",
                "s": "t",
                "ts": (time.perf_counter_ns() - self._origin_ns) / 1e3,
                "pid": os.getpid(),
                "tid": threading.get_ident(),
                "args": _jsonable(args),
            }
        )

    # -- results -------------------------------------------------------------------------
    @property
    def events(self) -> list[dict[str, Any]]:
        """Everything recorded, as Chrome trace events (device spans resolved; waits
        for their events to complete)."""
        with self._lock:
            events = list(self._events)
            spans = list(self._device_spans)
        for span, start, end in spans:
            end.synchronize()
            device_ms = start.elapsed_ms(end)
            events.append(
                {**span, "dur": device_ms * 1e3, "args": {**span["args"], "device_ms": device_ms}}
            )
        return sorted(events, key=lambda e: e["ts"])

    def summary(self) -> dict[str, dict[str, float]]:
        """Per range name: ``count``, ``total_ms`` and ``mean_ms`` (host time)."""
        table: dict[str, dict[str, float]] = {}
        for event in self.events:
            if event["ph"] != "X" or event["pid"] == "cuda":
                continue
            row = table.setdefault(event["name"], {"count": 0, "total_ms": 0.0})
            row["count"] += 1
            row["total_ms"] += event["dur"] / 1e3
        for row in table.values():
            row["mean_ms"] = row["total_ms"] / row["count"]
        return table

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write what was recorded as a Chrome/Perfetto trace (JSON), atomically.

        Returns the path written.
        """
        events = self.events
        names = {("cuda", e["tid"]) for e in events if e["pid"] == "cuda"}
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": os.getpid(),
                "args": {"name": "xpuruntime (host)"},
            },
            {
                "name": "process_name",
                "ph": "M",
                "pid": "cuda",
                "args": {"name": "xpuruntime (CUDA streams)"},
            },
        ] + [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": tid}}
            for pid, tid in sorted(names)
        ]
        document = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
        return atomic_write_text(path, json.dumps(document))

    # -- internals -------------------------------------------------------------------------
    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _complete(
        self, name: str, category: str, start: int, end: int, args: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": (start - self._origin_ns) / 1e3,
            "dur": (end - start) / 1e3,
            "pid": os.getpid(),
            "tid": threading.get_ident(),
            "args": _jsonable(args),
        }

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        for k, v in args.items()
    }

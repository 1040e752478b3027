"""Requests in flight: the worker threads behind ``InferenceSession.run_async`` and
``run_many``.

A session's engine runs as many requests at once as it says keep it busy
(``Engine.requests``: OpenVINO's optimal number of infer requests, ONNX Runtime's
requests of one thread each under ``performance='throughput'``, else 1), each on a worker
thread calling the engine's thread-safe ``run`` (both backends release the GIL while
they compute). At most ``limit`` requests are submitted and unfinished: a caller who
submits more waits for one to finish (backpressure), so memory stays bounded however
fast inputs arrive. A request's failure is its own future's; the next request runs as
usual.

Why not the backends' own queues: OpenVINO's ``AsyncInferQueue`` keeps a failed
request's exception and raises it again from every later ``start_async`` (OpenVINO
2026.4.1: one bad input fails every request after it), and ONNX Runtime's ``run_async``
needs an intra-op pool thread per request (it refuses a session of one intra-op thread,
the throughput setting) and shares that pool with the requests' own operators.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._errors import InvalidInputError

__all__ = ["RequestQueue"]


class RequestQueue:
    """Runs submitted calls on ``workers`` threads, with at most ``limit`` of them
    submitted and unfinished at a time."""

    def __init__(self, workers: int, limit: int) -> None:
        self._workers = workers
        self._limit = limit
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="xpuruntime-request")
        self._retired: list[ThreadPoolExecutor] = []  # narrower pools finishing their calls
        self._slots = threading.Semaphore(limit)
        self._resize = threading.Lock()
        self._closed = False

    @property
    def workers(self) -> int:
        return self._workers

    @property
    def limit(self) -> int:
        """The most requests submitted and not yet finished."""
        return self._limit

    def widen(self, workers: int, limit: int) -> None:
        """Run up to ``workers`` calls at once and let ``limit`` be unfinished (an engine
        that found it keeps more requests busy: OpenVINO's model compiled for a static
        shape can run more streams than its dynamic one). Calls already queued still run."""
        with self._resize:
            if workers <= self._workers or self._closed:
                return
            retired, self._executor = (
                self._executor,
                ThreadPoolExecutor(workers, thread_name_prefix="xpuruntime-request"),
            )
            self._retired.append(retired)
            for _ in range(max(0, limit - self._limit)):
                self._slots.release()
            self._workers, self._limit = workers, max(limit, self._limit)
        retired.shutdown(wait=False)

    def submit(self, call: Callable[[], Any]) -> Future:
        """Queue ``call``; waits while ``limit`` requests are unfinished.

        Raises
        ------
        InvalidInputError
            The queue was closed (its session was).
        """
        while not self._slots.acquire(timeout=0.1):
            if self._closed:
                break
        if self._closed:
            raise InvalidInputError("this InferenceSession is closed")
        while True:
            executor = self._executor
            try:
                future = executor.submit(call)
                break
            except RuntimeError:  # shut down between the check and the submit
                if self._closed or executor is self._executor:
                    self._slots.release()
                    raise InvalidInputError("this InferenceSession is closed") from None
                # widened meanwhile: the wider pool takes it
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def close(self) -> None:
        """Finish the requests running now, cancel those still queued (their futures
        raise ``CancelledError``), and stop the workers (idempotent)."""
        with self._resize:
            self._closed = True
        for executor in (*self._retired, self._executor):
            executor.shutdown(wait=True, cancel_futures=True)

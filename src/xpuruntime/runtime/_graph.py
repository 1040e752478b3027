"""CUDA graphs from stream capture: record a stream's work once, replay it cheaply.

A captured graph replays the same kernels on the same addresses, so whatever it reads
and writes must live in buffers that outlast it (a :class:`MemoryManager`'s, or
static tensors). Capture fails, and says why, when the captured work synchronises
with the host, uses the legacy default stream, or otherwise breaks capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._errors import CudaError, InvalidInputError
from ._cuda import check, error_for, make_current
from ._stream import Stream

__all__ = ["CudaGraph"]

_CAPTURE_HINT = (
    "work captured into a CUDA graph must stay on the capturing stream (or streams that "
    "wait on it) and must not synchronise with the host, use the legacy default stream, "
    "or allocate outside a stream-ordered pool"
)


class CudaGraph:
    """A CUDA graph captured from a :class:`Stream`, ready to replay.

    Examples
    --------
    >>> graph = CudaGraph()                                   # doctest: +SKIP
    >>> with graph.capture(stream):                           # doctest: +SKIP
    ...     enqueue_work(stream)                              # doctest: +SKIP
    >>> graph.replay(stream); stream.synchronize()            # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._graph = None
        self._exec = None
        self._stream: Stream | None = None

    @property
    def captured(self) -> bool:
        return self._exec is not None

    @property
    def node_count(self) -> int:
        """Number of nodes (kernels, copies, memsets) in the captured graph."""
        if self._graph is None:
            return 0
        cu = make_current(self._stream.device.index)
        _, count = check(cu.cuGraphGetNodes(self._graph, 0), "cuGraphGetNodes")
        return int(count)

    @contextlib.contextmanager
    def capture(self, stream: Stream) -> Iterator[CudaGraph]:
        """Capture the work queued on ``stream`` inside the block.

        Capture mode is *thread-local*: other threads may keep using CUDA, but this
        thread may not make calls that are unsafe during capture.

        Raises
        ------
        InvalidInputError
            When this graph was already captured, or ``stream`` is not a Stream.
        CudaError
            When capture was broken by the work in the block (the message says what is
            forbidden), or instantiation failed.
        """
        if self._exec is not None:
            raise InvalidInputError("capture: this CudaGraph is already captured; make a new one")
        if not isinstance(stream, Stream):
            raise InvalidInputError(f"capture: expected a Stream, got {type(stream).__name__}")
        if stream.handle == 0:
            raise InvalidInputError("capture: the legacy default stream cannot be captured")
        cu = make_current(stream.device.index)
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream._handle, mode), "cuStreamBeginCapture")
        failed = None
        try:
            yield self
        except CudaError as e:
            failed = e
            if e.code and "STREAM_CAPTURE" in e.code:
                raise CudaError(f"{e}; {_CAPTURE_HINT}", code=e.code) from e
            raise
        except BaseException as e:
            failed = e
            raise
        finally:
            err, graph = cu.cuStreamEndCapture(stream._handle)
            if failed is None:
                if int(err) != 0:
                    error = error_for(err, "capturing a CUDA graph")
                    raise CudaError(f"{error}; {_CAPTURE_HINT}", code=getattr(error, "code", None))
                self._graph = graph
                self._stream = stream
                self._exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            elif int(err) == 0 and graph is not None:
                cu.cuGraphDestroy(graph)

    def replay(self, stream: Stream | None = None) -> None:
        """Launch the captured work on ``stream`` (default: the capturing stream)."""
        if self._exec is None:
            raise InvalidInputError("replay: nothing was captured into this CudaGraph")
        stream = stream or self._stream
        cu = make_current(stream.device.index)
        check(cu.cuGraphLaunch(self._exec, stream._handle), "cuGraphLaunch")

    def close(self) -> None:
        """Destroy the graph (idempotent)."""
        if self._exec is not None:
            cu = make_current(self._stream.device.index)
            check(cu.cuGraphExecDestroy(self._exec), "cuGraphExecDestroy")
            check(cu.cuGraphDestroy(self._graph), "cuGraphDestroy")
        self._exec = self._graph = None

    def __enter__(self) -> CudaGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""CUDA streams and events over the driver API, interoperable with PyTorch and CuPy.

A :class:`Stream` owns a driver stream on one device's primary context (the context
PyTorch, CuPy and ONNX Runtime use), so its handle can be given to them: it speaks the
``__cuda_stream__`` protocol, and :meth:`Stream.wrap` adopts theirs. An :class:`Event`
marks a point in a stream: record it, wait on it from another stream, query it, time
the distance between two of them.
"""

from __future__ import annotations

from typing import Any

from .._errors import InvalidInputError
from ._cuda import check, driver, error_for, make_current
from ._device import Device

__all__ = ["Event", "Stream"]


def _cuda_device(device: Device | str | int | None) -> Device:
    if device is None:
        from ._device import get_current_device

        current = get_current_device()
        device = current if current.kind == "cuda" else Device("cuda:0")
    device = Device(device)
    if device.kind != "cuda":
        raise InvalidInputError(f"device: expected a CUDA device, got {device}")
    return device


class Stream:
    """A CUDA stream: an ordered queue of work on one device.

    Parameters
    ----------
    device : Device, str or int, optional
        The CUDA device (default: the current device if it is CUDA, else ``cuda:0``).
    priority : int
        Lower numbers run first; clamped by the driver to the device's range.
    blocking : bool
        False (default) creates a non-blocking stream that does not synchronise with the
        legacy default stream.

    Raises
    ------
    InvalidInputError
        For a device that is not a CUDA device.
    BackendUnavailableError
        Without cuda-bindings or the NVIDIA driver.
    CudaError
        When the driver cannot create the stream.

    Examples
    --------
    >>> stream = xrt.runtime.Stream("cuda:0")                 # doctest: +SKIP
    >>> torch_stream = torch.cuda.ExternalStream(stream.handle)  # doctest: +SKIP
    >>> stream.synchronize()                                 # doctest: +SKIP
    """

    __slots__ = ("_blocking", "_device", "_handle", "_order_event", "_owned", "_owner")

    def __init__(
        self, device: Device | str | int | None = None, *, priority: int = 0, blocking: bool = False
    ) -> None:
        self._device = _cuda_device(device)
        cu = make_current(self._device.index)
        flags = (
            cu.CUstream_flags.CU_STREAM_DEFAULT
            if blocking
            else cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        )
        self._handle = check(
            cu.cuStreamCreateWithPriority(flags, int(priority)),
            f"creating a stream on {self._device}",
        )
        self._owned = True
        self._owner = None
        self._order_event = None
        self._blocking = blocking

    @classmethod
    def wrap(cls, obj: Any, device: Device | str | int | None = None) -> Stream:
        """Adopt a stream made elsewhere, without taking ownership.

        Parameters
        ----------
        obj : object
            Anything with ``__cuda_stream__`` (cuda.core, recent PyTorch and CuPy), a
            ``torch.cuda.Stream`` (``cuda_stream``), a ``cupy.cuda.Stream`` (``ptr``),
            or a raw handle as an int (0 is the legacy default stream).
        device : optional
            The device the stream belongs to (default: the object's own, else current).
            The object is kept alive as long as the Stream.
        """
        if hasattr(obj, "__cuda_stream__"):
            version, handle = obj.__cuda_stream__()
            if version != 0:
                raise InvalidInputError(
                    f"stream: __cuda_stream__ version {version} is not supported (expected 0)"
                )
        elif hasattr(obj, "cuda_stream"):
            handle = obj.cuda_stream
        elif hasattr(obj, "ptr") and not isinstance(obj, int):
            handle = obj.ptr
        elif isinstance(obj, int) and not isinstance(obj, bool) and obj >= 0:
            handle = obj
        else:
            raise InvalidInputError(
                "stream: expected an object with __cuda_stream__, a torch.cuda.Stream, a "
                f"cupy.cuda.Stream or a handle int, got {type(obj).__name__}"
            )
        if device is None and hasattr(obj, "device") and hasattr(obj.device, "index"):
            device = obj.device.index  # torch.cuda.Stream knows its device
        elif device is None and hasattr(obj, "device_id"):
            device = obj.device_id  # CuPy
        from cuda.bindings import driver as cu

        self = cls.__new__(cls)
        self._device = _cuda_device(device)
        self._handle = cu.CUstream(int(handle))
        self._owned = False
        self._owner = obj  # the foreign stream must outlive this view of it
        self._order_event = None
        if int(handle) in (0, 1, 2):  # the default streams synchronise with the legacy one
            self._blocking = True
        else:
            cu = make_current(self._device.index)
            flags = int(check(cu.cuStreamGetFlags(self._handle), "cuStreamGetFlags"))
            self._blocking = not flags & int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return self

    # -- queries -------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        """The raw ``CUstream`` as an int (for ``torch.cuda.ExternalStream`` and the like)."""
        return int(self._handle)

    @property
    def device(self) -> Device:
        return self._device

    @property
    def blocking(self) -> bool:
        """Whether work on this stream waits for the legacy default stream's earlier work
        (and the other way round), as CUDA's blocking streams do."""
        return self._blocking

    @property
    def done(self) -> bool:
        """Whether all work queued so far has finished (never blocks)."""
        cu = make_current(self._device.index)
        err = cu.cuStreamQuery(self._handle)[0]
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), f"querying a stream on {self._device}")
        return True

    @property
    def priority(self) -> int:
        cu = make_current(self._device.index)
        return int(check(cu.cuStreamGetPriority(self._handle), "cuStreamGetPriority"))

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(version, handle)``."""
        return (0, int(self._handle))

    # -- actions -------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work queued on this stream has finished."""
        cu = make_current(self._device.index)
        check(cu.cuStreamSynchronize(self._handle), f"synchronising a stream on {self._device}")

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at this point of the stream; return it."""
        event = Event(self._device) if event is None else event
        event.record(self)
        return event

    def wait(self, event_or_stream: Event | Stream) -> None:
        """Make later work on this stream wait for ``event`` (or for all of ``stream``'s
        work queued so far); the host does not block."""
        if isinstance(event_or_stream, Stream):
            self.wait_for(event_or_stream.handle)
            return
        if not isinstance(event_or_stream, Event):
            raise InvalidInputError(
                f"wait: expected an Event or a Stream, got {type(event_or_stream).__name__}"
            )
        cu = make_current(self._device.index)
        check(cu.cuStreamWaitEvent(self._handle, event_or_stream._handle, 0), "cuStreamWaitEvent")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` on this stream.

        Either address may be host or device memory (unified addressing tells which);
        a pageable host side makes the copy synchronous.
        """
        cu = driver()
        # The stream names its context, so the copy is tried without making it current
        # first (that costs ~2 µs per call); a failure is retried with it current.
        if int(cu.cuMemcpyAsync(int(dst), int(src), int(nbytes), self._handle)[0]):
            cu = make_current(self._device.index)
            check(
                cu.cuMemcpyAsync(int(dst), int(src), int(nbytes), self._handle),
                f"copying {nbytes} bytes",
            )

    def wait_for(self, handle: int) -> None:
        """Make later work on this stream wait for the work queued so far on the stream
        with raw handle ``handle`` (1 is the legacy default stream), without blocking the
        host. One event is reused, so this costs two driver calls."""
        cu = make_current(self._device.index)
        if self._order_event is None:
            self._order_event = Event(self._device, timing=False)
        event = self._order_event._handle
        check(cu.cuEventRecord(event, cu.CUstream(handle)), "cuEventRecord")
        check(cu.cuStreamWaitEvent(self._handle, event, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        """Destroy the stream once its queued work is done (idempotent; foreign streams
        are left to their owner)."""
        if self._owned and self._handle is not None:
            cu = make_current(self._device.index)
            check(cu.cuStreamDestroy(self._handle), "cuStreamDestroy")
        self._handle = None
        self._owner = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        handle = "closed" if self._handle is None else hex(int(self._handle))
        return f"<Stream {handle} on {self._device}{'' if self._owned else ', foreign'}>"


class Event:
    """A marker in a stream's work, for ordering between streams and for timing.

    Parameters
    ----------
    device : Device, str or int, optional
        The CUDA device (default as for :class:`Stream`).
    timing : bool
        Record timestamps (needed by :meth:`elapsed_ms`); events without timing are
        cheaper to wait on.
    blocking : bool
        :meth:`synchronize` blocks the thread by sleeping instead of spinning.
    """

    __slots__ = ("_device", "_handle", "_recorded", "_timing")

    def __init__(
        self,
        device: Device | str | int | None = None,
        *,
        timing: bool = True,
        blocking: bool = False,
    ) -> None:
        self._device = _cuda_device(device)
        cu = make_current(self._device.index)
        flags = 0 if timing else int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self._handle = check(cu.cuEventCreate(flags), f"creating an event on {self._device}")
        self._timing = timing
        self._recorded = False

    @property
    def device(self) -> Device:
        return self._device

    @property
    def done(self) -> bool:
        """Whether the work before the recorded point has finished (never blocks).

        An event never recorded is done, as in CUDA.
        """
        cu = make_current(self._device.index)
        err = cu.cuEventQuery(self._handle)[0]
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def record(self, stream: Stream | Any = None) -> Event:
        """Mark the current end of ``stream``'s work (default: the legacy default stream).

        ``stream`` is a :class:`Stream` or anything :meth:`Stream.wrap` accepts.
        Returns this event.
        """
        if stream is None:
            stream = Stream.wrap(0, self._device)
        elif not isinstance(stream, Stream):
            stream = Stream.wrap(stream, self._device)
        if stream.device != self._device:
            raise InvalidInputError(
                f"event on {self._device} cannot be recorded on a stream of {stream.device}"
            )
        cu = make_current(self._device.index)
        check(cu.cuEventRecord(self._handle, stream._handle), "cuEventRecord")
        self._recorded = True
        return self

    def synchronize(self) -> None:
        """Block until the work before the recorded point has finished."""
        cu = make_current(self._device.index)
        check(cu.cuEventSynchronize(self._handle), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both recorded, with timing, and done.

        Raises
        ------
        InvalidInputError
            When either event was made without timing or never recorded.
        CudaError
            ``CUDA_ERROR_NOT_READY`` when ``end`` has not completed yet.
        """
        for name, e in (("start", self), ("end", end)):
            if not isinstance(e, Event):
                raise InvalidInputError(
                    f"elapsed_ms: {name} must be an Event, got {type(e).__name__}"
                )
            if not e._timing:
                raise InvalidInputError(f"elapsed_ms: the {name} event was made with timing=False")
            if not e._recorded:
                raise InvalidInputError(f"elapsed_ms: the {name} event was never recorded")
        cu = make_current(self._device.index)
        err, ms = cu.cuEventElapsedTime(self._handle, end._handle)
        if int(err) != 0:
            raise error_for(err, "cuEventElapsedTime")
        return float(ms)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        if self._handle is not None:
            cu = make_current(self._device.index)
            check(cu.cuEventDestroy(self._handle), "cuEventDestroy")
            self._handle = None

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Event on {self._device}{'' if self._timing else ', no timing'}>"

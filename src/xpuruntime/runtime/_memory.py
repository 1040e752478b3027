"""Device memory from a stream-ordered pool, pinned host buffers, and copies between them.

:class:`MemoryManager` owns one CUDA memory pool per device (``cuMemPoolCreate``), so
its allocations are stream-ordered (``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``:
allocating and freeing cost no device synchronisation) and its statistics are its own,
not mixed with PyTorch's or ONNX Runtime's. Buffers free themselves when the last
reference goes, or when :meth:`DeviceBuffer.free` says so (on a stream, in order).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._errors import InvalidInputError, OutOfMemoryError
from ._cuda import check, error_for, free_memory, make_current
from ._device import Device
from ._stream import Stream, _cuda_device

__all__ = ["DeviceArray", "DeviceBuffer", "MemoryManager", "MemoryStats", "PinnedBuffer"]

_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class MemoryStats:
    """A :class:`MemoryManager`'s pool, read now.

    ``reserved`` is what the pool holds from the device, ``used`` what live buffers
    take; ``*_peak`` are high-water marks since creation or :meth:`reset_peak`.
    ``fragmentation`` is ``1 - used / reserved`` (0 when nothing is reserved): the share
    of the pool's memory that no buffer uses.
    """

    device: str
    reserved: int
    used: int
    reserved_peak: int
    used_peak: int
    live_buffers: int
    allocations: int
    pinned: int

    @property
    def fragmentation(self) -> float:
        return 0.0 if self.reserved == 0 else 1.0 - self.used / self.reserved


class DeviceBuffer:
    """``nbytes`` of device memory from a :class:`MemoryManager`'s pool.

    Freed (stream-ordered) by :meth:`free`, or when garbage-collected. Use
    :meth:`view` to see it as a typed array that PyTorch, CuPy and ONNX Runtime accept.
    """

    __slots__ = ("__weakref__", "_finalizer", "_manager", "nbytes", "ptr")

    def __init__(self, manager: MemoryManager, ptr: int, nbytes: int) -> None:
        self._manager = manager
        self.ptr = ptr
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, manager._release, ptr, nbytes, None)
        self._finalizer.atexit = False  # the driver may be gone at interpreter exit

    @property
    def device(self) -> Device:
        return self._manager.device

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def view(self, shape: tuple[int, ...] | int, dtype: Any) -> DeviceArray:
        """A C-contiguous typed view of the start of this buffer.

        Raises
        ------
        InvalidInputError
            When the view would not fit, or the buffer was freed.
        """
        if self.freed:
            raise InvalidInputError("view: this DeviceBuffer was freed")
        shape, dtype, _ = _view_layout(shape, dtype, self.nbytes)
        return DeviceArray(self, shape, dtype)

    def free(self, stream: Stream | None = None) -> None:
        """Return the memory to the pool after ``stream``'s queued work (default: the
        legacy default stream). Idempotent."""
        if self._finalizer.detach() is not None:
            self._manager._release(self.ptr, self.nbytes, stream)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else hex(self.ptr)
        return f"<DeviceBuffer {self.nbytes} bytes at {state} on {self.device}>"


class DeviceArray:
    """A typed, C-contiguous view of a :class:`DeviceBuffer`.

    Speaks ``__cuda_array_interface__`` (version 3), so ``torch.as_tensor(a,
    device="cuda")``, ``cupy.asarray(a)`` and an :class:`~xpuruntime.InferenceSession`
    read it without copying. It keeps its buffer alive.
    """

    __slots__ = ("buffer", "dtype", "shape")

    def __init__(self, buffer: DeviceBuffer, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.buffer, self.shape, self.dtype = buffer, shape, dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.buffer.ptr, False),
            "version": 3,
            "strides": None,
            # No stream of its own: work queued by copy_from(..., stream) must be
            # finished, or ordered by the caller, before another consumer reads.
            "stream": None,
        }

    def copy_from(self, array: np.ndarray, stream: Stream | None = None) -> None:
        """Copy a host array of the same shape and dtype in (async on ``stream``; a
        pageable source makes the copy synchronous, a pinned one does not)."""
        array = _host_like(array, self.shape, self.dtype, "copy_from")
        self.buffer._manager.copy(self.ptr, array.ctypes.data, self.nbytes, stream)

    def to_numpy(self, stream: Stream | None = None) -> np.ndarray:
        """A host copy (waits for ``stream``'s queued work first)."""
        out = np.empty(self.shape, self.dtype)
        manager = self.buffer._manager
        manager.copy(out.ctypes.data, self.ptr, self.nbytes, stream)
        (stream or manager._default_stream).synchronize()
        return out

    def __repr__(self) -> str:
        return f"<DeviceArray {self.shape} {self.dtype} on {self.buffer.device}>"


class PinnedBuffer:
    """Page-locked host memory (``cuMemHostAlloc``): copies from it are truly async.

    :meth:`view` gives numpy arrays over it; they keep the buffer alive.
    """

    __slots__ = ("__weakref__", "_finalizer", "_manager", "_raw", "nbytes", "ptr")

    def __init__(self, manager: MemoryManager, ptr: int, nbytes: int) -> None:
        self._manager = manager
        self.ptr = ptr
        self.nbytes = nbytes
        self._raw = (ctypes.c_byte * nbytes).from_address(ptr)
        self._raw._owner = self  # numpy views hold _raw, which holds this buffer
        self._finalizer = weakref.finalize(self, manager._release_pinned, ptr, nbytes)
        self._finalizer.atexit = False

    def view(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A numpy array over the start of the buffer."""
        shape, dtype, count = _view_layout(shape, dtype, self.nbytes)
        return np.frombuffer(self._raw, dtype=dtype, count=count).reshape(shape)

    def __repr__(self) -> str:
        return f"<PinnedBuffer {self.nbytes} bytes>"


class MemoryManager:
    """Stream-ordered device memory from a pool of xpuruntime's own, with statistics.

    Parameters
    ----------
    device : Device, str or int, optional
        The CUDA device (default: current, else ``cuda:0``).
    release_threshold : int, optional
        Bytes the pool keeps reserved after a synchronisation instead of returning them
        to the driver (default: keep everything, so that reuse costs nothing; call
        :meth:`trim` to give memory back).
    max_size : int, optional
        A hard cap on the pool's size in bytes (default: no cap).

    Examples
    --------
    >>> mm = xrt.runtime.MemoryManager.instance("cuda:0")    # doctest: +SKIP
    >>> buf = mm.allocate(1 << 20)                           # doctest: +SKIP
    >>> x = buf.view((512, 512), "float32"); x.copy_from(host)  # doctest: +SKIP
    >>> mm.stats.used                                        # doctest: +SKIP
    1048576
    """

    _instances: ClassVar[dict[int, MemoryManager]] = {}
    _instances_lock = threading.Lock()

    def __init__(
        self,
        device: Device | str | int | None = None,
        *,
        release_threshold: int | None = None,
        max_size: int | None = None,
    ) -> None:
        self._device = _cuda_device(device)
        for name, value in (("release_threshold", release_threshold), ("max_size", max_size)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise InvalidInputError(f"{name}: expected an int >= 0 or None, got {value!r}")
        cu = make_current(self._device.index)
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = self._device.index
        if max_size is not None:
            props.maxSize = max_size
        self._pool = check(cu.cuMemPoolCreate(props), f"creating a memory pool on {self._device}")
        threshold = _UINT64_MAX if release_threshold is None else release_threshold
        check(
            cu.cuMemPoolSetAttribute(
                self._pool,
                cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                cu.cuuint64_t(threshold),
            ),
            "setting the pool's release threshold",
        )
        self._lock = threading.Lock()
        self._live = 0
        self._allocations = 0
        self._pinned = 0
        self._default_stream = Stream.wrap(0, self._device)

    @classmethod
    def instance(cls, device: Device | str | int | None = None) -> MemoryManager:
        """The process-wide manager of ``device`` (created on first use)."""
        device = _cuda_device(device)
        with cls._instances_lock:
            manager = cls._instances.get(device.index)
            if manager is None:
                manager = cls._instances[device.index] = cls(device)
            return manager

    @property
    def device(self) -> Device:
        return self._device

    @property
    def stats(self) -> MemoryStats:
        """The pool's reserved and used bytes, their peaks, and counts, read now."""
        cu = make_current(self._device.index)
        attr = cu.CUmemPool_attribute

        def read(which: Any) -> int:
            return int(check(cu.cuMemPoolGetAttribute(self._pool, which), "cuMemPoolGetAttribute"))

        return MemoryStats(
            device=str(self._device),
            reserved=read(attr.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            used=read(attr.CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            reserved_peak=read(attr.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
            used_peak=read(attr.CU_MEMPOOL_ATTR_USED_MEM_HIGH),
            live_buffers=self._live,
            allocations=self._allocations,
            pinned=self._pinned,
        )

    # -- actions -------------------------------------------------------------------------
    def allocate(self, nbytes: int, stream: Stream | None = None) -> DeviceBuffer:
        """``nbytes`` of device memory, usable by work queued on ``stream`` from now on.

        Raises
        ------
        InvalidInputError
            For a size that is not an int > 0.
        OutOfMemoryError
            Says what was asked, what the device has free and what the pool holds.
        """
        nbytes = _size("allocate", nbytes)
        stream = stream or self._default_stream
        cu = make_current(self._device.index)
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, self._pool, stream._handle)
        if int(err) != 0:
            error = error_for(err, f"allocating {nbytes} bytes on {self._device}")
            if isinstance(error, OutOfMemoryError):
                free, total = free_memory(self._device.index)
                stats = self.stats
                raise OutOfMemoryError(
                    f"allocating {_mib(nbytes)} on {self._device} failed: {_mib(free)} free "
                    f"of {_mib(total)}; xpuruntime's pool holds {_mib(stats.reserved)} "
                    f"({_mib(stats.used)} in use)"
                )
            raise error
        with self._lock:
            self._live += 1
            self._allocations += 1
        return DeviceBuffer(self, int(ptr), nbytes)

    def allocate_pinned(self, nbytes: int) -> PinnedBuffer:
        """``nbytes`` of page-locked host memory, for async host<->device copies."""
        nbytes = _size("allocate_pinned", nbytes)
        cu = make_current(self._device.index)
        ptr = check(
            cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE),
            f"allocating {_mib(nbytes)} of pinned host memory",
        )
        with self._lock:
            self._pinned += nbytes
        return PinnedBuffer(self, int(ptr), nbytes)

    def copy(self, dst: int, src: int, nbytes: int, stream: Stream | None = None) -> None:
        """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` on ``stream``.

        Either side may be host or device memory (unified addressing tells which).
        """
        (stream or self._default_stream).copy(dst, src, nbytes)

    def trim(self, keep_bytes: int = 0) -> None:
        """Give reserved memory that no buffer uses back to the driver, down to
        ``keep_bytes`` (takes effect for memory whose frees have completed)."""
        cu = make_current(self._device.index)
        check(cu.cuMemPoolTrimTo(self._pool, int(keep_bytes)), "cuMemPoolTrimTo")

    def reset_peak(self) -> None:
        """Restart the ``*_peak`` statistics from the current values."""
        cu = make_current(self._device.index)
        attr = cu.CUmemPool_attribute
        for which in (attr.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, attr.CU_MEMPOOL_ATTR_USED_MEM_HIGH):
            check(cu.cuMemPoolSetAttribute(self._pool, which, cu.cuuint64_t(0)), "resetting a peak")

    # -- buffer lifetimes ------------------------------------------------------------------
    def _release(self, ptr: int, nbytes: int, stream: Stream | None) -> None:
        cu = make_current(self._device.index)
        handle = (stream or self._default_stream)._handle
        check(cu.cuMemFreeAsync(ptr, handle), f"freeing {nbytes} bytes")
        with self._lock:
            self._live -= 1

    def _release_pinned(self, ptr: int, nbytes: int) -> None:
        cu = make_current(self._device.index)
        check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")
        with self._lock:
            self._pinned -= nbytes

    def __repr__(self) -> str:
        return f"<MemoryManager of {self._device}>"


def _size(what: str, nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise InvalidInputError(f"{what}: nbytes must be an int > 0, got {nbytes!r}")
    return int(nbytes)


def _view_layout(shape: Any, dtype: Any, nbytes: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, element count)`` of a view that must fit in ``nbytes``."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if any(d < 0 for d in shape) or count * dtype.itemsize > nbytes:
        raise InvalidInputError(
            f"view: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes; the "
            f"buffer has {nbytes}"
        )
    return shape, dtype, count


def _host_like(array: Any, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise InvalidInputError(f"{what}: expected a numpy array, got {type(array).__name__}")
    if array.shape != shape or array.dtype != dtype:
        raise InvalidInputError(
            f"{what}: expected shape {shape} and dtype {dtype}, got {array.shape} {array.dtype}"
        )
    return np.ascontiguousarray(array)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"

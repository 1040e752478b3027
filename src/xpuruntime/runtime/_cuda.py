"""The CUDA driver through NVIDIA's cuda-bindings: one checking helper for every call."""

from __future__ import annotations

import threading
from typing import Any

from .._errors import BackendUnavailableError, CudaError, OutOfMemoryError

__all__ = ["check", "driver", "free_memory", "make_current"]

_init_lock = threading.Lock()
_driver: Any = None  # the driver module once cuInit has succeeded
_primary: dict[int, Any] = {}  # device index -> retained primary context


def driver() -> Any:
    """The ``cuda.bindings.driver`` module, initialised (``cuInit``) once.

    Raises
    ------
    BackendUnavailableError
        When cuda-bindings is not installed, or the NVIDIA driver library is not found.
    CudaError
        When the driver cannot be initialised (no device, driver too old).
    """
    global _driver
    if _driver is not None:
        return _driver
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise BackendUnavailableError(
            "the CUDA driver bindings are not installed: pip install xpuruntime[cuda] "
            "(cuda-bindings)"
        ) from e
    with _init_lock:
        try:
            result = cu.cuInit(0)
        except Exception as e:  # cuda-bindings raises when libcuda itself cannot be found
            raise BackendUnavailableError(
                f"the NVIDIA driver library (libcuda) cannot be loaded: {e}"
            ) from e
        check(result, "cuInit")
        _driver = cu
    return cu


def make_current(index: int) -> Any:
    """Make device ``index``'s primary context current on this thread; return the driver.

    The primary context is the one PyTorch, CuPy and ONNX Runtime use, so memory and
    streams made here are usable by them. It is retained once per process and kept.
    """
    cu = driver()
    ctx = _primary.get(index)
    if ctx is None:
        with _init_lock:
            ctx = _primary.get(index)
            if ctx is None:
                dev = check(cu.cuDeviceGet(index), f"cuDeviceGet({index})")
                ctx = check(cu.cuDevicePrimaryCtxRetain(dev), f"retaining cuda:{index}'s context")
                _primary[index] = ctx
    check(cu.cuCtxSetCurrent(ctx), f"making cuda:{index} current")
    return cu


def free_memory(index: int) -> tuple[int, int]:
    """``(free, total)`` bytes on device ``index``, read now (``cuMemGetInfo``)."""
    cu = make_current(index)
    free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(err, *values)`` result, raising on a non-success code.

    Returns the single value, a tuple of values, or None.

    Raises
    ------
    OutOfMemoryError
        For ``CUDA_ERROR_OUT_OF_MEMORY``.
    CudaError
        For every other error, with the driver's error name and message.
    """
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise error_for(err, what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def error_for(err: Any, what: str) -> CudaError | OutOfMemoryError:
    """The xpuruntime error for a driver error code ``err`` met while doing ``what``."""
    from cuda.bindings import driver as cu

    name = _describe(cu.cuGetErrorName, err) or f"CUresult {int(err)}"
    message = _describe(cu.cuGetErrorString, err) or ""
    text = f"{what} failed: {message}" if message else f"{what} failed"
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return OutOfMemoryError(f"{text} [{name}]")
    return CudaError(text, code=name)


def _describe(fn: Any, err: Any) -> str | None:
    try:
        code, text = fn(err)
        return text.decode() if int(code) == 0 and text else None
    except Exception:  # describing an error must never hide it
        return None

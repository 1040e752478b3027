"""The CUDA driver through NVIDIA's cuda-bindings: one checking helper for every call."""

from __future__ import annotations

from typing import Any

from .._errors import BackendUnavailableError, CudaError, OutOfMemoryError

__all__ = ["check", "driver"]


def driver() -> Any:
    """The ``cuda.bindings.driver`` module, initialised (``cuInit``) once.

    Raises
    ------
    BackendUnavailableError
        When cuda-bindings is not installed.
    CudaError
        When the driver cannot be initialised (no driver, no device).
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise BackendUnavailableError(
            "the CUDA driver bindings are not installed: pip install xpuruntime[cuda] "
            "(cuda-bindings)"
        ) from e
    check(cu.cuInit(0), "cuInit")
    return cu


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(err, *values)`` result, raising on a non-success code.

    Returns the single value, a tuple of values, or None.
    """
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        from cuda.bindings import driver as cu

        name = _describe(cu.cuGetErrorName, err) or f"CUresult {int(err)}"
        message = _describe(cu.cuGetErrorString, err) or ""
        error_cls = OutOfMemoryError if name == "CUDA_ERROR_OUT_OF_MEMORY" else CudaError
        text = f"{what} failed: {message}" if message else f"{what} failed"
        if error_cls is OutOfMemoryError:
            raise OutOfMemoryError(f"{text} [{name}]")
        raise CudaError(text, code=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _describe(fn: Any, err: Any) -> str | None:
    try:
        code, text = fn(err)
        return text.decode() if int(code) == 0 and text else None
    except Exception:  # describing an error must never hide it
        return None

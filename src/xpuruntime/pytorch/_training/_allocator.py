"""PyTorch's CUDA memory allocator: the choices it really has, when each can be made,
and statistics that say how well memory is used.

Kinds
-----
``default``
    The caching allocator as PyTorch starts it (fixed-size segments, split and cached).
``expandable_segments``
    The caching allocator growing segments in place (virtual memory mapping), which
    avoids most fragmentation when sizes vary (e.g. sequence lengths). Can be switched
    on and off at any time; it applies to segments created afterwards.
``cuda_malloc_async``
    CUDA's stream-ordered allocator (``cudaMallocAsync``) as PyTorch's backend. PyTorch
    reads its backend once, when ``torch`` is imported (measured: setting it afterwards
    is refused by PyTorch even before CUDA is initialised), so it can only be chosen by
    the environment of the process: ``PYTORCH_ALLOC_CONF=backend:cudaMallocAsync``
    (``PYTORCH_CUDA_ALLOC_CONF`` before torch 2.9). :func:`set_allocator` checks it.

A scoped pool (:func:`memory_pool`) sends every allocation in a ``with`` block to a
private ``torch.cuda.MemPool``, e.g. to keep one model's memory apart from another's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import PolicyError, UnsupportedOperationError
from ...policies._choices import choose

__all__ = ["AllocatorStats", "allocator_stats", "memory_pool", "reset_allocator", "set_allocator"]

ALLOCATOR_KINDS = ("default", "expandable_segments", "cuda_malloc_async")
_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_initial_expandable: bool | None = None  # the setting before our first change
_expandable: bool | None = None


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of PyTorch's CUDA allocator on one device (bytes unless named).

    Attributes
    ----------
    kind : str
        ``default``, ``expandable_segments`` or ``cuda_malloc_async``.
    allocated, reserved : int
        Bytes held by live tensors, and bytes the allocator holds from CUDA.
    peak_allocated, peak_reserved : int
        Their highs since the last ``torch.cuda.reset_peak_memory_stats``.
    free_in_reserved : int
        ``reserved - allocated``: cached, not in use.
    largest_free_block : int or None
        The largest cached block a request could get without new memory from CUDA
        (None for ``cuda_malloc_async``, which PyTorch cannot see into).
    fragmentation : float or None
        ``1 - largest_free_block / free_in_reserved``: 0 when the cached memory is one
        block, near 1 when it is scattered in pieces too small to use.
    segments : int or None
        Segments obtained from CUDA.
    alloc_retries, ooms : int
        Times the allocator freed its cache and retried, and out-of-memory errors.
    """

    kind: str
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    free_in_reserved: int
    largest_free_block: int | None
    fragmentation: float | None
    segments: int | None
    alloc_retries: int
    ooms: int


def set_allocator(kind: str | bool = "default", *, enabled: bool | None = None) -> None:
    """Choose PyTorch's CUDA allocator.

    Parameters
    ----------
    kind : {'default', 'expandable_segments', 'cuda_malloc_async'}
    enabled : bool, optional
        The seed documents' form (``set_allocator(enabled=True)``, 05 §6): True turns
        on the allocator that keeps fragmentation down (``expandable_segments``), False
        restores ``default``. ``set_allocator(True)`` reads the same.

    Raises
    ------
    PolicyError
        An unknown kind (the message lists them).
    UnsupportedOperationError
        The kind cannot be chosen now: ``cuda_malloc_async`` after torch was imported
        with another backend (the message gives the environment variable to set),
        ``default``/``expandable_segments`` in a process running ``cudaMallocAsync``,
        or no CUDA device.

    Examples
    --------
    >>> xpt.set_allocator("expandable_segments")     # doctest: +SKIP
    """
    if isinstance(kind, bool):
        enabled, kind = kind, "default"
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise PolicyError(f"set_allocator: enabled must be True or False, got {enabled!r}")
        kind = "expandable_segments" if enabled else "default"
    kind = choose("allocator kind", kind, ALLOCATOR_KINDS)
    backend = _backend()
    if kind == "cuda_malloc_async":
        if backend != "cudaMallocAsync":
            raise UnsupportedOperationError(
                "set_allocator('cuda_malloc_async'): too late in this process. PyTorch fixes "
                f"its allocator backend when torch is imported (here: {backend!r}); start the "
                "process with PYTORCH_ALLOC_CONF=backend:cudaMallocAsync "
                "(PYTORCH_CUDA_ALLOC_CONF on torch < 2.9)"
            )
        return
    if backend == "cudaMallocAsync":
        raise UnsupportedOperationError(
            f"set_allocator({kind!r}): this process runs PyTorch's cudaMallocAsync backend, "
            "fixed when torch was imported; start the process without "
            "backend:cudaMallocAsync in PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF"
        )
    _set_expandable(kind == "expandable_segments")


def reset_allocator() -> None:
    """Put the allocator setting back as it was before :func:`set_allocator` (cached
    memory is released to CUDA as well)."""
    if _initial_expandable is not None and _backend() != "cudaMallocAsync":
        _set_expandable(_initial_expandable)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def allocator_stats(device: int | torch.device | str | None = None) -> AllocatorStats:
    """Where the allocator's memory is, on ``device`` (default: the current one).

    Raises
    ------
    UnsupportedOperationError
        No CUDA device.

    Examples
    --------
    >>> s = xpt.allocator_stats(); s.reserved - s.allocated, s.fragmentation  # doctest: +SKIP
    """
    _require_cuda("allocator_stats")
    stats = torch.cuda.memory_stats(device)
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    free = max(0, reserved - allocated)
    largest = segments = fragmentation = None
    if _backend() != "cudaMallocAsync":
        snapshot = torch.cuda.memory_snapshot()
        index = _device_index(device)
        mine = [s for s in snapshot if s.get("device") == index]
        segments = len(mine)
        blocks = [b["size"] for s in mine for b in s["blocks"] if b["state"] == "inactive"]
        largest = max(blocks, default=0)
        fragmentation = 0.0 if free == 0 else 1.0 - largest / free
    return AllocatorStats(
        kind=_kind(),
        allocated=allocated,
        reserved=reserved,
        peak_allocated=stats.get("allocated_bytes.all.peak", 0),
        peak_reserved=stats.get("reserved_bytes.all.peak", 0),
        free_in_reserved=free,
        largest_free_block=largest,
        fragmentation=fragmentation,
        segments=segments,
        alloc_retries=stats.get("num_alloc_retries", 0),
        ooms=stats.get("num_ooms", 0),
    )


@contextlib.contextmanager
def memory_pool(pool: Any = None) -> Iterator[Any]:
    """Send every CUDA allocation of the block to a private memory pool.

    Parameters
    ----------
    pool : torch.cuda.MemPool, optional
        A pool to reuse (default: a new one), e.g. to put two blocks' tensors together.

    Yields
    ------
    torch.cuda.MemPool
        The pool; ``pool.snapshot()`` lists its segments. Its memory returns to CUDA
        when the pool and every tensor allocated in it are gone.

    Raises
    ------
    UnsupportedOperationError
        No CUDA device, or a torch without ``torch.cuda.MemPool`` (before 2.6), or the
        cudaMallocAsync backend.

    Examples
    --------
    >>> with xpt.memory_pool() as pool:                         # doctest: +SKIP
    ...     cache = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    """
    _require_cuda("memory_pool")
    if not hasattr(torch.cuda, "MemPool"):
        raise UnsupportedOperationError(
            f"memory_pool needs torch.cuda.MemPool (torch >= 2.6); this is {torch.__version__}"
        )
    if _backend() == "cudaMallocAsync":
        raise UnsupportedOperationError(
            "memory_pool: scoped pools belong to the caching allocator; this process runs "
            "the cudaMallocAsync backend"
        )
    pool = torch.cuda.MemPool() if pool is None else pool
    with torch.cuda.use_mem_pool(pool):
        yield pool


# -- helpers ---------------------------------------------------------------------------------
def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise UnsupportedOperationError(f"{what}: PyTorch sees no CUDA device")


def _device_index(device: int | torch.device | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _backend() -> str:
    """PyTorch's allocator backend: ``native`` or ``cudaMallocAsync``."""
    if torch.cuda.is_available():
        return torch.cuda.get_allocator_backend()
    return "native"  # a CPU-only build has only the default


def _kind() -> str:
    if _backend() == "cudaMallocAsync":
        return "cuda_malloc_async"
    return "expandable_segments" if _current_expandable() else "default"


def _current_expandable() -> bool:
    if _expandable is not None:
        return _expandable
    for var in _ENV_VARS:
        settings = os.environ.get(var, "")
        if "expandable_segments:true" in settings.replace(" ", "").lower():
            return True
    return False


def _set_expandable(on: bool) -> None:
    global _expandable, _initial_expandable
    _require_cuda("set_allocator")
    if _initial_expandable is None:
        _initial_expandable = _current_expandable()
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter(setting)
    except RuntimeError as e:
        raise UnsupportedOperationError(f"set_allocator: PyTorch refused {setting!r}: {e}") from e
    _expandable = on

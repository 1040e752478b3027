"""Atomic file writes and the cache directory, shared by policies and caches."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "default_cache_dir"]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new, never half.

    The bytes go to a temporary file in the same directory, are flushed to disk, and the
    temporary file is renamed over ``path`` (``os.replace`` is atomic on POSIX and
    Windows). Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` as UTF-8 with :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def default_cache_dir() -> Path:
    """Where caches live when a policy names no ``cache_dir``.

    ``$XPURUNTIME_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/xpuruntime``, else
    ``~/.cache/xpuruntime``. Read when called, never at import.
    """
    explicit = os.environ.get("XPURUNTIME_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "xpuruntime"

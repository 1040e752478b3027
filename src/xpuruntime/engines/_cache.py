"""EngineCache: compiled engines stored by content address, verified on every load.

An entry's key is the SHA-256 of everything that decides what was compiled (the
model's bytes with its external data, engine and library versions, device model and
driver, precision, input shapes, options): change any and the key changes, so a stale
engine is never found. Each entry carries its own checksum; a truncated or corrupted
entry is detected on load, logged, deleted, and reported as a miss, so the caller
rebuilds it. Writes are atomic (temporary file + rename), so processes sharing the
directory see a whole entry or none; eviction (least recently used first, down to a
size cap) runs under an advisory file lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InvalidInputError
from .._files import atomic_write_bytes

__all__ = ["CacheEntry", "EngineCache"]

logger = logging.getLogger("xpuruntime.engines")

_MAGIC = b"XRTENGINE1\n"
_SUFFIX = ".xrte"
_DEFAULT_CAP = 4 * 2**30


@dataclass(frozen=True)
class CacheEntry:
    """One stored engine: its key, payload size, last use (epoch seconds) and metadata."""

    key: str
    size: int
    last_used: float
    meta: dict[str, Any]


class EngineCache:
    """A directory of compiled engines, addressed by content.

    Parameters
    ----------
    root : path
        The directory (created when first written).
    max_bytes : int
        Size cap; after each write, least recently used entries are evicted until the
        total is under it (default 4 GiB).

    Examples
    --------
    >>> cache = EngineCache(tmp_path / "engines")                      # doctest: +SKIP
    >>> key = EngineCache.key(model=digest, engine="openvino", device="CPU")  # doctest: +SKIP
    >>> blob = cache.get(key) or cache.put(key, compile_it()).data     # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int = _DEFAULT_CAP) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidInputError(f"max_bytes: expected an int > 0, got {max_bytes!r}")
        self._root = Path(root)
        self._max_bytes = max_bytes

    @staticmethod
    def key(**parts: Any) -> str:
        """The content address of ``parts`` (JSON-serialisable values), as hex SHA-256."""
        try:
            canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        except TypeError as e:
            raise InvalidInputError(f"cache key parts must be JSON-serialisable: {e}") from e
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def root(self) -> Path:
        return self._root

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def entries(self) -> list[CacheEntry]:
        """Every readable entry, most recently used first (payloads are not verified)."""
        found = []
        for path in self._files():
            try:
                header, _ = _read_header(path)
                found.append(
                    CacheEntry(path.stem, header["size"], path.stat().st_mtime, header["meta"])
                )
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    @property
    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self._files())

    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``, verified; None on a miss or a bad entry.

        A bad entry (truncated, corrupted, wrong format) is logged and deleted.
        """
        path = self._path(key)
        try:
            header, offset = _read_header(path)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._discard(path, f"unreadable ({e})")
            return None
        if len(data) != header["size"]:
            self._discard(path, f"truncated: {len(data)} of {header['size']} bytes")
            return None
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            self._discard(path, "checksum mismatch (corrupted)")
            return None
        with contextlib.suppress(OSError):  # last use, for LRU eviction
            os.utime(path)
        return data

    def put(self, key: str, data: bytes, meta: dict[str, Any] | None = None) -> Path:
        """Store ``data`` under ``key`` atomically, then evict down to the cap.

        Returns the entry's path.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"put: data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        header = json.dumps(
            {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "meta": meta or {}},
            sort_keys=True,
        ).encode()
        path = atomic_write_bytes(
            self._path(key), _MAGIC + struct.pack("<Q", len(header)) + header + data
        )
        self.evict()
        return path

    def evict(self, max_bytes: int | None = None) -> list[str]:
        """Delete least recently used entries until the total is at most ``max_bytes``
        (default: the cap). Returns the evicted keys."""
        cap = self._max_bytes if max_bytes is None else max_bytes
        evicted = []
        with self._locked():
            files = []
            for path in self._files():
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    files.append((stat.st_mtime, stat.st_size, path))
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= cap:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    evicted.append(path.stem)
                total -= size
        if evicted:
            logger.info(
                "engine cache %s: evicted %d entries over the cap", self._root, len(evicted)
            )
        return evicted

    def clear(self) -> None:
        """Delete every entry."""
        self.evict(0)

    # -- internals -------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not (
            isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)
        ):
            raise InvalidInputError(
                f"cache key: expected 64 hex digits (EngineCache.key), got {key!r}"
            )
        return self._root / key[:2] / f"{key}{_SUFFIX}"

    def _files(self) -> Iterator[Path]:
        if self._root.is_dir():
            yield from self._root.glob(f"*/*{_SUFFIX}")

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("engine cache: discarding %s: %s; it will be rebuilt", path, why)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # Windows: renames stay atomic; eviction is best effort
            yield
            return
        with open(self._root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError("not an xpuruntime engine cache entry")
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("header cut short")
        (length,) = struct.unpack("<Q", raw)
        header = f.read(length)
    if len(header) != length:
        raise ValueError("header cut short")
    parsed = json.loads(header)
    if not isinstance(parsed, dict) or not {"sha256", "size", "meta"} <= set(parsed):
        raise ValueError("header lacks sha256/size/meta")
    return parsed, len(_MAGIC) + 8 + length

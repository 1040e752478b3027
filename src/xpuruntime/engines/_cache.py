"""EngineCache: compiled engines stored by content address, trusted only when they prove it.

An entry's key is the SHA-256 of everything that decides what was compiled (the
model's bytes with its external data, engine and library versions, device model and
driver, precision, input shapes, options). The entry states that whole key inside, so a
file renamed, copied or linked into another entry's place is recognised and refused;
its payload carries a checksum. A damaged entry in any form (truncated, corrupted, an
absurd length field, a directory or a link in its place) is detected on load, logged,
removed and reported as a miss, so the caller rebuilds it.

The cache is private to its user: directories are created 0700 and files 0600 whatever
the umask, and an entry owned by someone else, or a directory others can write to, is
refused with a warning. A directory that cannot be used at all (a file in the way, a
read-only or full disk) makes every call a logged miss: a session then runs without
the cache, never fails because of it.

Writes are atomic (temporary file + rename), so processes sharing the directory see a
whole entry or none. Eviction (least recently used first, down to a size cap) runs
under an advisory file lock and also removes temporary files whose writer died.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InvalidInputError
from .._files import (
    UnsafeDirectoryError,
    atomic_write_bytes,
    check_private_dir,
    private_dir,
    temp_file_writer_pid,
)

__all__ = ["CacheEntry", "CacheKey", "EngineCache", "admit"]

logger = logging.getLogger("xpuruntime.engines")

_MAGIC = b"XRTENGINE2\n"
_SUFFIX = ".xrte"
_DEFAULT_CAP = 4 * 2**30
_MAX_HEADER = 1 << 20
_ORPHAN_AGE = 3600.0  # seconds after which a temporary file is an orphan, writer or not
_HEX = frozenset("0123456789abcdef")


class CacheKey(str):
    """A content address (64 hex digits) that also carries the parts it was made from.

    Made by :meth:`EngineCache.key`; ``canonical`` is the JSON text that was hashed and
    that an entry stores, so that an entry can prove which key it belongs to.
    """

    canonical: str

    def __new__(cls, parts: dict[str, Any]) -> CacheKey:
        try:
            canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"cache key parts must be JSON-serialisable: {e}") from e
        key = super().__new__(cls, hashlib.sha256(canonical.encode()).hexdigest())
        key.canonical = canonical
        return key


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
        The directory (created 0700 when first written).
    max_bytes : int
        Size cap; after each write, least recently used entries are evicted until the
        total is under it (default 4 GiB). An entry larger than the cap is not kept.

    Attributes
    ----------
    note : str or None
        Why the last ``get`` or ``put`` did not use the cache (an unusable directory, a
        refused or damaged entry, a failed write), or None.

    Examples
    --------
    >>> cache = EngineCache(tmp_path / "engines")                      # doctest: +SKIP
    >>> key = EngineCache.key(model=digest, engine="openvino", device="CPU")  # doctest: +SKIP
    >>> blob = cache.get(key)                                         # doctest: +SKIP
    >>> if blob is None: cache.put(key, compile_it(), {"engine": "openvino"})  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int = _DEFAULT_CAP) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidInputError(f"max_bytes: expected an int > 0, got {max_bytes!r}")
        self._root = Path(root)
        self._max_bytes = max_bytes
        self.note: str | None = None

    @staticmethod
    def key(**parts: Any) -> CacheKey:
        """The content address of ``parts`` (JSON-serialisable values)."""
        return CacheKey(parts)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def problem(self) -> str | None:
        """Why this directory cannot be used as a cache, or None (creates nothing)."""
        try:
            self._check_tree(create=False)
        except OSError as e:
            return _describe(e)
        return None

    @property
    def entries(self) -> list[CacheEntry]:
        """Every readable entry, most recently used first (payloads are not verified)."""
        found = []
        for path in self._files():
            try:
                with _open_entry(path) as f:
                    header, _ = _read_header(f, os.fstat(f.fileno()).st_size)
                    mtime = os.fstat(f.fileno()).st_mtime
                found.append(CacheEntry(path.stem, header["size"], mtime, header["meta"]))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    @property
    def total_bytes(self) -> int:
        """Bytes on disk: entries and temporary files."""
        total = 0
        for path in [*self._files(), *self._temp_files()]:
            with contextlib.suppress(OSError):
                total += path.lstat().st_size
        return total

    # -- actions ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``, verified; None on a miss or a bad entry.

        A damaged entry, or one that belongs to another key, is logged and removed; one
        owned by another user is refused with a warning. An unusable directory is a
        logged miss. ``note`` says why when None is returned for any reason but absence.
        """
        found = self.get_entry(key)
        return None if found is None else found[0]

    def get_entry(self, key: str) -> tuple[bytes, dict[str, Any]] | None:
        """As :meth:`get`, with the metadata the entry was stored with."""
        self.note = None
        path = self._path(key)
        try:
            if not self._root.exists():
                return None
            self._check_tree(create=False, sub=path.parent)
        except OSError as e:
            return self._unusable(e)
        try:
            with _open_entry(path) as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise ValueError(f"not a regular file ({stat.filemode(info.st_mode)})")
                if hasattr(os, "getuid") and info.st_uid != os.getuid():
                    self.note = f"entry {path.name} belongs to uid {info.st_uid}; refused"
                    logger.warning("engine cache: %s", self.note)
                    return None
                if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    raise ValueError("writable by other users")
                header, offset = _read_header(f, info.st_size)
                _check_key(header, key)
                if info.st_size - offset != header["size"]:
                    raise ValueError(
                        f"truncated: {info.st_size - offset} of {header['size']} bytes"
                    )
                data = f.read(header["size"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, OverflowError, MemoryError) as e:
            self._discard(path, str(e) if isinstance(e, ValueError) else _describe(e))
            return None
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            self._discard(path, "checksum mismatch (corrupted)")
            return None
        with contextlib.suppress(OSError):  # last use, for LRU eviction
            os.utime(path)
        return data, dict(header.get("meta") or {})

    def put(self, key: CacheKey, data: bytes, meta: dict[str, Any] | None = None) -> Path | None:
        """Store ``data`` under ``key`` atomically, then evict down to the cap.

        Returns
        -------
        Path or None
            The entry's path, or None when it was not kept (larger than the cap, or the
            directory unusable); ``note`` and the log say why.
        """
        self.note = None
        if not isinstance(key, CacheKey):
            raise InvalidInputError(
                f"put: key must come from EngineCache.key(...), got {type(key).__name__}"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"put: data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        header = json.dumps(
            {
                "key": key.canonical,
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "meta": meta or {},
            },
            sort_keys=True,
        ).encode()
        blob = _MAGIC + struct.pack("<Q", len(header)) + header + data
        path = self._path(key)
        if len(blob) > self._max_bytes:
            self.note = (
                f"not kept: the entry is {len(blob)} bytes, over the cap of {self._max_bytes}"
            )
            logger.warning("engine cache %s: %s", self._root, self.note)
            return None
        try:
            self._check_tree(create=True, sub=path.parent)
            if path.is_symlink() or path.is_dir():
                self._discard(path, "not a regular file")
            atomic_write_bytes(path, blob, private=True)
            self.evict()
        except OSError as e:
            return self._unusable(e)
        if not path.exists():
            self.note = "not kept: evicted at once"
            return None
        return path

    def evict(self, max_bytes: int | None = None) -> list[str]:
        """Delete least recently used entries until the total is at most ``max_bytes``
        (default: the cap), after removing temporary files whose writer died. Returns
        the evicted keys."""
        cap = self._max_bytes if max_bytes is None else max_bytes
        evicted = []
        with self._locked():
            orphans = 0
            files = []
            for path in self._temp_files():
                with contextlib.suppress(OSError):
                    info = path.lstat()
                    if _is_orphan(path, info):
                        path.unlink()
                        orphans += 1
                    else:
                        files.append((float("inf"), info.st_size, path))  # counted, kept
            for path in self._files():
                with contextlib.suppress(OSError):
                    info = path.lstat()
                    files.append((info.st_mtime, info.st_size, path))
            total = sum(size for _, size, _ in files)
            for mtime, size, path in sorted(files, key=lambda f: f[0]):
                if total <= cap or mtime == float("inf"):
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    evicted.append(path.stem)
                total -= size
        if orphans:
            logger.info(
                "engine cache %s: removed %d temporary file(s) left by dead writers",
                self._root,
                orphans,
            )
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
        if not (isinstance(key, str) and len(key) == 64 and set(key) <= _HEX):
            raise InvalidInputError(
                f"cache key: expected 64 hex digits (EngineCache.key), got {_short(key)}"
            )
        return self._root / key[:2] / f"{key}{_SUFFIX}"

    def _check_tree(self, *, create: bool, sub: Path | None = None) -> None:
        """Raise unless the root (and ``sub``) are private directories; with ``create``,
        make them. Without it, a missing directory ends the check."""
        for directory in (self._root, sub):
            if directory is None:
                continue
            if create:
                private_dir(directory)
            elif not check_private_dir(directory):
                return

    def _unusable(self, error: OSError) -> None:
        self.note = f"unavailable: {_describe(error)}"
        logger.warning("engine cache %s %s; running without it", self._root, self.note)
        return None

    def _files(self) -> Iterator[Path]:
        if self._root.is_dir():
            yield from self._root.glob(f"*/*{_SUFFIX}")

    def _temp_files(self) -> Iterator[Path]:
        if self._root.is_dir():
            yield from self._root.glob(f"*/.*{_SUFFIX}.*.tmp")

    def _discard(self, path: Path, why: str) -> None:
        self.note = f"discarded a bad entry: {why}"
        logger.warning("engine cache: discarding %s: %s; it will be rebuilt", path, why)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("engine cache: could not remove %s: %s", path, _describe(e))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        private_dir(self._root)
        try:
            import fcntl
        except ImportError:  # Windows: renames stay atomic; eviction is best effort
            yield
            return
        fd = os.open(self._root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def admit(
    cache: EngineCache,
    key: CacheKey,
    artifact: bytes,
    meta: dict[str, Any],
    samples: Callable[[], dict[str, Any]],
    run_fresh: Callable[[dict[str, Any]], list[Any]],
    run_reloaded: Callable[[dict[str, Any]], list[Any]],
) -> str:
    """Store a compiled engine's ``artifact`` only if the engine loaded back from it
    gives the compiled engine's outputs on ``samples()``; returns the cache state for
    the engine's settings.

    ``run_reloaded`` runs first: a failing run can leave a compiled model unusable
    (OpenVINO), and the fresh one must stay good.
    """
    import numpy as np

    try:
        feeds = samples()
        again = run_reloaded(feeds)
        fresh = run_fresh(feeds)
    except Exception as e:
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return f"not stored: the reloaded engine could not be checked ({why})"
    for index, (a, b) in enumerate(zip(fresh, again)):
        a, b = np.asarray(a), np.asarray(b)
        difference = None
        if a.shape != b.shape or a.dtype != b.dtype:
            difference = f"is {b.dtype}{list(b.shape)}, the compiled one's {a.dtype}{list(a.shape)}"
        elif a.dtype.kind in "fc":
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            if not np.allclose(a64, b64, rtol=1e-5, atol=1e-6, equal_nan=True):
                with np.errstate(invalid="ignore"):
                    worst = float(np.nanmax(np.abs(a64 - b64))) if a.size else 0.0
                difference = f"differs from the compiled one's (max abs difference {worst:.3g})"
        elif not np.array_equal(a, b):
            difference = "differs from the compiled one's"
        if difference is not None:
            logger.warning(
                "engine not cached: the reloaded engine's output %d %s", index, difference
            )
            return f"not stored: the reloaded engine's output {index} {difference}"
    if cache.put(key, artifact, meta) is None:
        return cache.note or "not stored"
    return f"stored {key[:12]}"


def _open_entry(path: Path) -> Any:
    """Open an entry without following a link and without blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    return os.fdopen(os.open(path, flags), "rb")


def _read_header(f: Any, file_size: int) -> tuple[dict[str, Any], int]:
    if f.read(len(_MAGIC)) != _MAGIC:
        raise ValueError("not an xpuruntime engine cache entry (or an older format)")
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("header cut short")
    (length,) = struct.unpack("<Q", raw)
    offset = len(_MAGIC) + 8 + length
    if length > _MAX_HEADER or offset > file_size:
        raise ValueError(f"header length field {length} is damaged")
    header = f.read(length)
    if len(header) != length:
        raise ValueError("header cut short")
    parsed = json.loads(header)
    if (
        not isinstance(parsed, dict)
        or not {"key", "sha256", "size", "meta"} <= set(parsed)
        or not isinstance(parsed["size"], int)
        or not isinstance(parsed["key"], str)
        or not isinstance(parsed["meta"], dict)
    ):
        raise ValueError("header lacks key/sha256/size/meta")
    return parsed, offset


def _check_key(header: dict[str, Any], key: str) -> None:
    """The entry must state the key it is filed under: a valid entry of another model,
    copied or linked into this place, states its own."""
    stored = header["key"]
    if isinstance(key, CacheKey):
        same = stored == key.canonical
    else:
        same = hashlib.sha256(stored.encode()).hexdigest() == key
    if not same:
        raise ValueError("the entry states another key (copied or linked into this place)")


def _is_orphan(path: Path, info: os.stat_result) -> bool:
    if time.time() - info.st_mtime > _ORPHAN_AGE:
        return True
    pid = temp_file_writer_pid(path.name)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _describe(error: OSError) -> str:
    if isinstance(error, UnsafeDirectoryError):
        return str(error)
    name = os.strerror(error.errno) if error.errno else type(error).__name__
    where = f" ({error.filename})" if error.filename else ""
    return f"{name}{where}" if error.errno else f"{error}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

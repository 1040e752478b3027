"""Atomic file writes, private cache directories and bounded reads of user files."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = [
    "UnsafeDirectoryError",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_private_dir",
    "default_cache_dir",
    "private_dir",
    "read_regular_file",
    "temp_file_writer_pid",
]

_TMP_SUFFIX = ".tmp"


class UnsafeDirectoryError(OSError):
    """A cache directory that another user owns or can write to (not used, not trusted)."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) as a directory only its owner can use.

    New directories get mode 0700 whatever the umask. An existing directory must be
    owned by the current user and not writable by group or others; the last component
    must not be a symbolic link.

    Raises
    ------
    UnsafeDirectoryError
        The directory is another user's, or others can write to it.
    OSError
        It cannot be created (a file in the way, a read-only or full disk).
    """
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        else:
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    check_private_dir(path)
    return path


def check_private_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` exists; raise if it is not a directory only its owner (the
    current user) can write to. Creates nothing.

    Raises
    ------
    NotADirectoryError, UnsafeDirectoryError
        As :func:`private_dir`.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeDirectoryError(f"{path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
        )
    return True


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, private: bool = False) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new, never half.

    The bytes go to a temporary file in the same directory (mode 0600, named
    ``.<name>.<pid>.<random>.tmp`` so that an orphan can be told from a live write), are
    flushed to disk, and the temporary file is renamed over ``path`` (``os.replace`` is
    atomic on POSIX and Windows). Missing parent directories are created, mode 0700 with
    ``private`` (for caches; see :func:`private_dir`).
    """
    path = Path(path)
    if private:
        private_dir(path.parent)
    elif not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=_TMP_SUFFIX
    )
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


def temp_file_writer_pid(name: str) -> int | None:
    """The process id in a temporary file name written by :func:`atomic_write_bytes`."""
    if not (name.startswith(".") and name.endswith(_TMP_SUFFIX)):
        return None
    parts = name[: -len(_TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def read_regular_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """Read a regular file of at most ``limit`` bytes, in bounded time.

    FIFOs, devices (``/dev/zero``), sockets and directories are refused before they are
    read, so a read never blocks or runs without end.

    Raises
    ------
    FileNotFoundError
        The path does not exist.
    ValueError
        Not a regular file, or larger than ``limit``; the message says which.
    OSError
        Any other failure to read.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {path} is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > limit:
            raise ValueError(f"{what} {path} is {info.st_size} bytes; the limit is {limit} bytes")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while being read
                raise ValueError(f"{what} {path} is over the limit of {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


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

"""On-disk cache of best_performance measurements, one small JSON file per key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from .._files import atomic_write_bytes, private_dir, read_regular_file

__all__ = ["MeasurementCache"]

logger = logging.getLogger("xpuruntime.dispatch")


class MeasurementCache:
    """Seconds per candidate, stored under ``directory/<sha256(key)>.json``.

    Entries are written atomically; an unreadable or malformed entry is logged, removed
    and treated as absent, so it is measured again.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(directory)

    @property
    def directory(self) -> Path:
        return self._directory

    def _path(self, key: str) -> Path:
        return self._directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def get(self, key: str) -> dict[str, float] | None:
        """The stored timings for ``key``, or None."""
        path = self._path(key)
        try:
            data = json.loads(read_regular_file(path, 1 << 20, "measurement cache entry"))
            if data.get("key") != key:
                raise ValueError("entry belongs to another key")
            times = {str(k): float(v) for k, v in data["seconds"].items()}
        except FileNotFoundError:
            return None
        except NotADirectoryError as e:
            logger.warning("measurement cache %s not usable: %s", self._directory, e)
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("discarding unreadable measurement cache entry %s: %s", path, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return times

    def spreads(self, key: str) -> dict[str, float]:
        """The relative spread of each candidate's timing stored for ``key`` (empty where
        none was stored)."""
        try:
            data = json.loads(
                read_regular_file(self._path(key), 1 << 20, "measurement cache entry")
            )
            return {str(k): float(v) for k, v in data.get("spread", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def put(
        self, key: str, seconds: dict[str, float], spreads: dict[str, float] | None = None
    ) -> None:
        """Store the timings for ``key`` (and the relative spread of each)."""
        payload = {"key": key, "seconds": seconds, "spread": spreads or {}, "created": time.time()}
        text = json.dumps(payload, indent=2, sort_keys=True).encode()
        try:
            private_dir(self._directory)
            atomic_write_bytes(self._path(key), text, private=True)
        except OSError as e:  # a cache that cannot be written is not a failed selection
            logger.warning("measurement cache %s not written: %s", self._directory, e)

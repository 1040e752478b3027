"""Models compiled again for the input shapes they are run with.

A backend compiles a model whose inputs have dynamic dimensions for any shape: it infers
shapes and plans memory on every run, and picks kernels that serve every size. Compiled
for one shape (OpenVINO's ``model.reshape`` before compiling, as ``benchmark_app -shape``
does), the same model runs faster: PP-OCRv4 det at 1x3x640x640 1.24x, cls at 8x3x48x192
1.14x (OpenVINO 2026.4 on a 2-core AMD EPYC VM). :class:`StaticShapes` keeps those
compiled forms, one per shape, made on the shape's first run, at most ``limit``. Every
run of a shape runs on one compiled model, so a session gives the same outputs for the
same inputs: runs of a shape being compiled for wait for it; shapes past the limit, one
that failed to compile or whose compiled form failed a run, run on the dynamic model
from then on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("xpuruntime.engines")

__all__ = ["StaticShapes", "shapes_key"]

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


def shapes_key(feeds: dict[str, Any], names: Any) -> Shapes:
    """The input shapes of ``feeds`` (of the inputs ``names``), as a dictionary key."""
    return tuple((name, feeds[name].shape) for name in names)


class StaticShapes:
    """Compiled models, one per input shape, made by ``compile_for``."""

    def __init__(self, compile_for: Callable[[dict[str, tuple[int, ...]]], Any], limit: int):
        self._compile_for = compile_for
        self._limit = limit
        self._compiled: dict[Shapes, Any] = {}
        self._refused: set[Shapes] = set()
        self._compiling: dict[Shapes, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, key: Shapes) -> Any | None:
        """The model compiled for ``key``, compiled now if room is left (a run compiling
        it already is waited for); None: run the dynamic model."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            if key in self._refused:
                return None
            done = self._compiling.get(key)
            if done is None:
                if len(self._compiled) + len(self._compiling) >= self._limit:
                    return None
                self._compiling[key] = threading.Event()
        if done is not None:
            done.wait()
            return self._compiled.get(key)
        try:
            compiled = self._compile_for(dict(key))
        except Exception as e:  # the dynamic model runs this shape
            logger.warning("could not compile the model for input shapes %s: %s", dict(key), e)
            compiled = None
        with self._lock:
            if compiled is None:
                self._refused.add(key)
            else:
                self._compiled[key] = compiled
            self._compiling.pop(key).set()
        return compiled

    def drop(self, key: Shapes) -> None:
        """Stop using the model compiled for ``key`` (a run on it failed)."""
        with self._lock:
            if self._compiled.pop(key, None) is not None:
                self._refused.add(key)

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()

    @property
    def forms(self) -> list[tuple[dict[str, tuple[int, ...]], Any]]:
        """The shapes compiled for and their compiled models, in the order made."""
        return [(dict(key), compiled) for key, compiled in list(self._compiled.items())]

"""KernelRegistry: op -> the candidates that can run it, in preference order."""

from __future__ import annotations

import threading
from typing import Any

from .._errors import PolicyError
from ._decision import Candidate

__all__ = ["KernelRegistry"]


class KernelRegistry:
    """Candidates per op, in registration order (the default auto preference order).

    Engines register under the op ``"engine"``; PyTorch kernels under their op name
    (``"matmul"``, ``"attention"``, ...). A candidate is any object with a ``name`` and a
    ``supports(ctx) -> Support`` method.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._candidates: dict[str, dict[str, Any]] = {}

    def register(self, op: str, candidate: Candidate, *, replace: bool = False) -> Candidate:
        """Add ``candidate`` for ``op``; returns it (so this works as a class decorator).

        Raises
        ------
        PolicyError
            If a candidate of that name is already registered and ``replace`` is False,
            or the candidate lacks ``name`` / ``supports``.
        """
        name = getattr(candidate, "name", None)
        if not isinstance(name, str) or not callable(getattr(candidate, "supports", None)):
            raise PolicyError(
                f"register({op!r}, ...): a candidate needs a str 'name' and a "
                f"'supports(ctx)' method, got {candidate!r}"
            )
        with self._lock:
            ops = self._candidates.setdefault(op, {})
            if name in ops and not replace and ops[name] is not candidate:
                raise PolicyError(f"{op}: a candidate named {name!r} is already registered")
            ops[name] = candidate
        return candidate

    def unregister(self, op: str, name: str) -> None:
        """Remove a candidate (no error if absent)."""
        with self._lock:
            self._candidates.get(op, {}).pop(name, None)

    @property
    def ops(self) -> list[str]:
        """Every op with at least one candidate."""
        with self._lock:
            return sorted(op for op, names in self._candidates.items() if names)

    def names(self, op: str) -> list[str]:
        """The candidates' names for ``op``, in preference order."""
        with self._lock:
            return list(self._candidates.get(op, {}))

    def candidates(self, op: str) -> list[Any]:
        """The candidates for ``op``, in preference order."""
        with self._lock:
            return list(self._candidates.get(op, {}).values())

    def get(self, op: str, name: str) -> Any:
        """The candidate ``name`` for ``op``.

        Raises
        ------
        PolicyError
            If there is none; the message lists the registered names.
        """
        # Read without the lock (dict reads are atomic), so that a torch.compile trace,
        # which cannot enter a lock, can look a kernel up.
        found = self._candidates.get(op, {}).get(name)
        if found is None:
            raise PolicyError(f"{op}: no candidate named {name!r}; registered: {self.names(op)}")
        return found

"""The dispatch log: a record of every decision, when enabled."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .._files import atomic_write_text
from ._decision import Decision

__all__ = ["DispatchLog", "DispatchRecord"]


@dataclass(frozen=True)
class DispatchRecord:
    """One logged decision: what was chosen, why, for what context, and how long it took."""

    op: str
    chosen: str
    source: str
    reason: str
    requested: str | None
    rejected: tuple[tuple[str, str], ...]
    context: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float | None = None
    timestamp: float = field(default_factory=time.time)
    rank: int | None = None
    """The process's rank in a torch.distributed job (None outside one)."""

    # The seed documents' field names (05_training_module §7, TASK_012).
    @property
    def op_name(self) -> str:
        """The op (``op``)."""
        return self.op

    @property
    def selected_kernel(self) -> str:
        """The kernel that was chosen (``chosen``)."""
        return self.chosen

    @property
    def input_shape(self) -> list[list[int]] | None:
        """The shapes of the call's tensors, where the record has them."""
        return self.context.get("shapes")

    @property
    def dtype(self) -> str | None:
        """The call's dtype, where the record has it."""
        return self.context.get("dtype")

    @property
    def elapsed_us(self) -> float | None:
        """``elapsed_s`` in microseconds."""
        return None if self.elapsed_s is None else self.elapsed_s * 1e6

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rejected"] = [list(pair) for pair in self.rejected]
        return data


class DispatchLog:
    """A thread-safe, bounded list of :class:`DispatchRecord`; off until enabled.

    Parameters
    ----------
    capacity : int
        The most records kept; older ones are dropped first.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._records: list[DispatchRecord] = []
        self._enabled = False
        self._capacity = capacity
        self.rank: int | None = None
        """Stamped on every record; set by ``xpuruntime.pytorch.distributed``."""

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    @property
    def records(self) -> list[DispatchRecord]:
        """A copy of the records, oldest first."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def record(
        self,
        decision: Decision,
        context: dict[str, Any] | None = None,
        elapsed_s: float | None = None,
    ) -> None:
        """Append a record for ``decision`` if the log is enabled."""
        if not self._enabled:
            return
        self.append(
            DispatchRecord(
                op=decision.op,
                chosen=decision.chosen,
                source=decision.source,
                reason=decision.reason,
                requested=decision.requested,
                rejected=decision.rejected,
                context=dict(context or {}),
                elapsed_s=elapsed_s,
            )
        )

    def append(self, entry: DispatchRecord) -> None:
        """Append a record made elsewhere (an op seen running), if the log is enabled."""
        if not self._enabled:
            return
        if self.rank is not None and entry.rank is None:
            entry = replace(entry, rank=self.rank)
        with self._lock:
            self._records.append(entry)
            if len(self._records) > self._capacity:
                del self._records[: len(self._records) - self._capacity]

    def export_json(self, path: str | os.PathLike[str]) -> Path:
        """Write every record to ``path`` as a JSON list (atomically)."""
        text = json.dumps([r.to_dict() for r in self.records], indent=2, default=str)
        return atomic_write_text(path, text + "\n")

"""Support answers and Decisions: the vocabulary of selection."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Candidate", "Decision", "Support", "DECISION_SOURCES"]

DECISION_SOURCES = ("policy", "auto", "fallback", "frozen")


@dataclass(frozen=True)
class Support:
    """A candidate's answer to "can you run this?", with the reason either way.

    Examples
    --------
    >>> Support.no("fp32 inputs; flash_v2 needs fp16 or bf16")
    Support(ok=False, reason='fp32 inputs; flash_v2 needs fp16 or bf16', missing_backend=False)
    """

    ok: bool
    reason: str = ""
    missing_backend: bool = False
    error: Exception | None = field(default=None, repr=False, compare=False)
    """The xpuruntime error a check raised, kept so that a final refusal can raise its
    type (a ``ModelLoadError`` stays one) with the backend's exception chained."""

    @classmethod
    def yes(cls, reason: str = "supported") -> Support:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)

    @classmethod
    def unavailable(cls, reason: str) -> Support:
        """No, because a library or runtime is missing (strict mode raises
        :class:`~xpuruntime.BackendUnavailableError` for it)."""
        return cls(False, reason, missing_backend=True)

    def __bool__(self) -> bool:
        return self.ok


@runtime_checkable
class Candidate(Protocol):
    """What the dispatcher selects among: an engine class or a kernel."""

    name: str

    def supports(self, ctx: Any) -> Support: ...


@dataclass(frozen=True)
class Decision:
    """Which candidate was chosen for an op, by whom, and why the others were not.

    Attributes
    ----------
    op : str
        What was being chosen for (``"engine"``, ``"matmul"``, ...).
    chosen : str
        The candidate that will run.
    source : {'policy', 'auto', 'fallback', 'frozen'}
        ``policy``: the policy named it and it was honoured. ``auto``: the policy left
        the choice open. ``fallback``: the policy named another candidate that could not
        run (see ``rejected``). ``frozen``: the policy left the op to auto and carries
        a frozen decision for the call's shape class, which ran.
    reason : str
        Why ``chosen`` was taken.
    requested : str or None
        What the policy asked for (None or ``'auto'`` when it left the choice open).
    strategy : str
        The auto strategy used (``first_supported`` or ``best_performance``).
    candidates : tuple of str
        Every candidate considered, in the order they were considered.
    rejected : tuple of (str, str)
        Each candidate not chosen because it could not run, with its reason.
    measurements : dict of str to float
        Seconds per run of each measured candidate (``best_performance`` only).
    """

    op: str
    chosen: str
    source: str
    reason: str
    requested: str | None = None
    strategy: str = "first_supported"
    candidates: tuple[str, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    measurements: dict[str, float] = field(default_factory=dict)

    def explain(self) -> str:
        """A few lines a person can read: what was asked, what ran, and why."""
        asked = self.requested if self.requested not in (None, "auto") else "auto"
        lines = [
            f"{self.op}: {self.chosen} ({self.source}; asked: {asked}, strategy: {self.strategy})",
            f"  chosen because: {self.reason}",
        ]
        for name in self.candidates:
            if name == self.chosen:
                mark = "chosen"
            else:
                mark = dict(self.rejected).get(name, "supported, not chosen")
            timing = self.measurements.get(name)
            timing = f" [{timing * 1e3:.3f} ms]" if timing is not None else ""
            lines.append(f"  - {name}{timing}: {mark}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "op": self.op,
            "chosen": self.chosen,
            "source": self.source,
            "reason": self.reason,
            "requested": self.requested,
            "strategy": self.strategy,
            "candidates": list(self.candidates),
            "rejected": [list(pair) for pair in self.rejected],
            "measurements": dict(self.measurements),
        }

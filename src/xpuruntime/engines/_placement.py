"""Where ONNX Runtime placed each node: the proof that an execution provider ran the model.

``session.get_providers()`` lists an EP even when it received no node, and ORT moves
nodes an EP cannot take to the CPU EP without a word. With the session config
``session.record_ep_graph_assignment_info=1`` (ONNX Runtime >= 1.24), a session reports
the EP of every node it runs; :class:`Placement` holds that report for one session and
says what ran off the EP that was asked for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["Placement", "RECORD_PLACEMENT"]

RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"
"""The session config entry that makes ORT record the placement."""


@dataclass(frozen=True)
class Placement:
    """Node placement of one ONNX Runtime session.

    Attributes
    ----------
    requested : str
        The execution provider the session was asked to run on.
    nodes : tuple of (ep, node name, op type)
        Every node the session runs, with the EP it was assigned to.
    """

    requested: str
    nodes: tuple[tuple[str, str, str], ...]

    @classmethod
    def of(cls, session: Any, requested: str) -> Placement | None:
        """The placement ``session`` recorded, or None where ORT cannot report it."""
        report = getattr(session, "get_provider_graph_assignment_info", None)
        if report is None:
            return None
        nodes = []
        for subgraph in report():
            for node in subgraph.get_nodes():
                op = f"{node.domain}:{node.op_type}" if node.domain else node.op_type
                nodes.append((subgraph.ep_name, node.name, op))
        return cls(requested, tuple(nodes))

    @property
    def off_target(self) -> tuple[tuple[str, str, str], ...]:
        """Nodes on another EP than the requested one."""
        return tuple(n for n in self.nodes if n[0] != self.requested)

    @property
    def on_target(self) -> int:
        """How many nodes run on the requested EP."""
        return len(self.nodes) - len(self.off_target)

    def describe(self) -> str:
        """``'QNNExecutionProvider 2 of 3 nodes (MatMul, Relu); CPUExecutionProvider 1
        (Det)'``: nodes per EP, with their op types."""
        by_ep: dict[str, Counter] = {}
        for ep, _, op in self.nodes:
            by_ep.setdefault(ep, Counter())[op] += 1
        if not by_ep:
            return f"{self.requested}: no nodes (the graph is empty)"
        parts = []
        for ep in sorted(by_ep, key=lambda e: (e != self.requested, e)):
            ops = by_ep[ep]
            count = sum(ops.values())
            of = len(self.nodes) if ep == self.requested else count
            total = f" of {of}" if ep == self.requested else ""
            kinds = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(ops.items()))
            parts.append(f"{ep} {count}{total} node{'s' if of != 1 else ''} ({kinds})")
        return "; ".join(parts)

    def describe_off_target(self, limit: int = 20) -> str:
        """The nodes off the requested EP, by name and op type (at most ``limit``)."""
        shown = [f"{name or '<unnamed>'} ({op}) on {ep}" for ep, name, op in self.off_target]
        more = len(shown) - limit
        return ", ".join(shown[:limit]) + (f" and {more} more" if more > 0 else "")

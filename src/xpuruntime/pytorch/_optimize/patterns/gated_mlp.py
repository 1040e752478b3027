"""A gated MLP, ``down(silu(gate(x)) * up(x))`` (Llama's MLP and its many copies) or its
GELU-tanh form (Gemma's), recognised on probe inputs whatever the class or child names:
a forward bound on the instance whose activation is the ``swiglu`` / ``geglu`` op
(:func:`ops.swiglu`, :func:`ops.geglu`), unless the policy names ``torch`` for it; with
the projections pattern enabled, gate and up run as that op and the activation takes
its joined output whole."""

from __future__ import annotations

import torch
from torch import nn

from ..._functional._projections import joined_halves, projections
from .._probes import gated_mlp_match
from .._report import Finding
from .._run import Run
from . import projections as joined

SWIGLUS = Finding(
    "fused_swiglus",
    "SwiGLU(s)",
    "{}: its SwiGLU runs as one op",
    triton=True,
    doc="the SwiGLU MLPs, ``down(silu(gate(x)) * up(x))``, whose activation runs as ``swiglu``",
)
GEGLUS = Finding(
    "fused_geglus",
    "GeGLU(s)",
    "{}: its GeGLU runs as one op",
    triton=True,
    doc="the GeGLU MLPs, ``down(gelu_tanh(gate(x)) * up(x))`` (Gemma's), whose activation runs as ``geglu``",
)
_OPS = ("swiglu", "geglu")


class GatedMLP:
    findings = (SWIGLUS, GEGLUS)

    def enabled(self, run: Run) -> bool:
        return any(run.fuses(op) for op in _OPS)

    def apply(self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module) -> bool:
        match = gated_mlp_match(module)
        if match is None:
            return False
        names, why, op = match
        kind = type(module).__name__
        if names is None:
            run.skip(path, f"{kind} {why}")
        elif not run.fuses(op):
            run.skip(path, f"{kind} {why}; the policy names no {op} kernel")
        else:
            join = joined.PATTERN.enabled(run)
            run.bind(module, _forward(op, *names, join))
            run.report.add(SWIGLUS if op == "swiglu" else GEGLUS, [path])
            if join and names[1]:
                group = f"{path}: {names[0]}, {names[1]}"
                if joined.taken(run, [getattr(module, n) for n in names[:2]], group):
                    run.report.add(joined.JOINED, [group])
        return False


def _forward(op: str, gate: str, up: str, down: str, join: bool):
    """A forward whose activation is the policy's ``op`` (``swiglu`` or ``geglu``);
    ``up`` empty: ``gate``'s output holds gate and up as its two halves. With ``join``,
    gate and up run as the policy's ``projections`` op, and where it gives the halves of
    one output, the activation takes that output whole (packed: neither direction copies
    a half). Its children are read at each call, so that a layer swapped in later (a
    LoRA wrapper, our routed Linear) is the one that runs."""
    from ..._functional import _activations

    activation = getattr(_activations, op)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, down)(activation(getattr(self, gate)(x), getattr(self, up)(x)))

    def joined_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        g, u = projections(x, getattr(self, gate), getattr(self, up))
        packed = joined_halves(g, u)
        h = activation(g, u) if packed is None else activation(packed)
        return getattr(self, down)(h)

    def packed(self: nn.Module, x: torch.Tensor) -> torch.Tensor:  # gate_up's two halves
        return getattr(self, down)(activation(getattr(self, gate)(x)))

    return (joined_forward if join else forward) if up else packed


PATTERN = GatedMLP()

"""Linear layers that take one input (attention's ``self.q_proj(h)``, ``self.k_proj(h)``,
``self.v_proj(h)``; a gated MLP's gate and up) called together as the ``projections``
op: one GEMM over the joined weights where it picks ``fused`` (one cast and one kept
copy of the input, its gradient summed inside one GEMM). Unless the policy names
``torch`` for it, or names a ``linear`` kernel (the layers are then that op's). A
group's frozen weights (a LoRA base) are moved into one tensor, so that the GEMM reads
them joined with no copy per call (:mod:`.._ops._infra._joined_storage`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..._functional._lora import lora_group
from ..._functional._projections import projections
from ..._linear_view import linear_view
from ..._ops._infra._joined_storage import store_joined
from .._report import Finding
from .._run import Run

JOINED = Finding(
    "joined_projections",
    "projection group(s)",
    "{}: run as one op",
    "joined",
    doc='linear layers of one input run as ``projections``, as ``"<path>: q_proj, k_proj, v_proj"``',
)
STORED = Finding(
    "stored_joined",
    "frozen weight group(s) as one tensor",
    "{}: their frozen weights stored as one tensor",
    "stored",
    listed_when_empty=False,
    doc="joined projections whose frozen weights (a LoRA base) now lie in one tensor, which the GEMM reads without a copy; ``revert`` separates them again",
)


class Projections:
    kind = "projections"
    helper = staticmethod(projections)
    findings = (JOINED, STORED)

    def enabled(self, run: Run) -> bool:
        linears = run.policy is not None and run.policy.get("linear") is not None
        return run.fuses("projections") and not linears

    def takes(self, run: Run, module: nn.Module) -> bool:
        return self.enabled(run)

    def accept(self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]):
        """The groups that run as one op (:func:`taken`)."""
        groups = [(f"{path}: {', '.join(names)}", names) for names in found]
        return [group for group, names in groups
                if taken(run, [getattr(module, n) for n in names], group)]  # fmt: skip


def taken(run: Run, layers: list[nn.Module], group: str) -> bool:
    """Whether ``layers`` (reported as ``group``) run as one op (:func:`joins`); if so,
    they are noted in the run (``run.joined``: a later swap leaves them to that op), and
    their weights, where frozen, stored as one tensor."""
    if not joins(run, layers):
        return False
    run.joined.update(id(layer) for layer in layers)
    run.report.status.joined.append(tuple(weakref.ref(layer) for layer in layers))
    weights = [linear_view(layer).base.weight for layer in layers]
    if store_joined(weights):
        run.report.add(STORED, [group])
        # (Held weakly: a weight replaced later, as fp8_base replaces it, is freed.)
        refs = [weakref.ref(w) for w in weights]
        run.report.on_revert(lambda: _own_storage(refs))
    return True


def _own_storage(refs: list[weakref.ref]) -> None:
    """Each weight still alive in a storage of its own again (the values unchanged)."""
    with torch.no_grad():
        for ref in refs:
            weight = ref()
            if weight is not None:
                weight.data = weight.data.clone()


def joins(run: Run, layers: list[nn.Module]) -> bool:
    """Whether ``layers`` run as one op: plain linear layers of one input width, or LoRA
    layers (4-bit bases without an adapter among them) the ``lora_linear`` op runs
    together (unless the policy names ``torch``)."""
    views = [linear_view(layer) for layer in layers]
    if all(v is not None and v.dense for v in views):
        return len({v.in_features for v in views}) == 1
    return run.fuses("lora_linear") and lora_group(tuple(layers)) is not None


PATTERN = Projections()

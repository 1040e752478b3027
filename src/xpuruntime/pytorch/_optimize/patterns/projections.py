"""Linear layers that take one input (attention's ``self.q_proj(h)``, ``self.k_proj(h)``,
``self.v_proj(h)``; a gated MLP's gate and up) called together as the ``projections``
op: one GEMM over the joined weights where it picks ``fused`` (one cast and one kept
copy of the input, its gradient summed inside one GEMM). Unless the policy names
``torch`` for it, or names a ``linear`` kernel (the layers are then that op's)."""

from __future__ import annotations

from torch import nn

from ..._functional._lora import lora_group
from ..._functional._projections import projections
from ..._linear_view import linear_view
from .._report import Finding
from .._run import Run

JOINED = Finding(
    "joined_projections",
    "projection group(s)",
    "{}: run as one op",
    "joined",
    doc='linear layers of one input run as ``projections``, as ``"<path>: q_proj, k_proj, v_proj"``',
)


class Projections:
    kind = "projections"
    helper = staticmethod(projections)
    findings = (JOINED,)

    def enabled(self, run: Run) -> bool:
        linears = run.policy is not None and run.policy.get("linear") is not None
        return run.fuses("projections") and not linears

    def takes(self, run: Run, module: nn.Module) -> bool:
        return self.enabled(run)

    def accept(self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]):
        """The groups that run as one op (:func:`taken`)."""
        return [
            f"{path}: {', '.join(names)}"
            for names in found
            if taken(run, [getattr(module, n) for n in names])
        ]


def taken(run: Run, layers: list[nn.Module]) -> bool:
    """Whether ``layers`` run as one op (:func:`joins`); if so, they are noted in the run
    (``run.joined``: a later swap leaves them to that op)."""
    if not joins(run, layers):
        return False
    run.joined.update(id(layer) for layer in layers)
    return True


def joins(run: Run, layers: list[nn.Module]) -> bool:
    """Whether ``layers`` run as one op: plain linear layers of one input width, or LoRA
    layers the ``lora_linear`` op runs together (unless the policy names ``torch``)."""
    views = [linear_view(layer) for layer in layers]
    if all(v is not None and v.plain for v in views):
        return len({v.in_features for v in views}) == 1
    return run.fuses("lora_linear") and lora_group(tuple(layers)) is not None


PATTERN = Projections()

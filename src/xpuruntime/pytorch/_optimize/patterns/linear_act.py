"""A linear layer (or transformers' ``Conv1D``) and a GELU module, by probe (``h =
self.<layer>(h); h = self.<act>(h)``, GPT-2's MLP), as the ``linear_gelu`` op
(:func:`ops.fused_linear_gelu`), unless the policy names ``torch`` for it. Where a
policy names ``linear_gelu`` or ``mlp``, the fx pattern (:mod:`.fx`) takes those pairs."""

from __future__ import annotations

from torch import nn

from ..._functional._linear import linear_act, register_linear_act
from .._probes import gelu_form, linear_kind
from .._report import Finding
from .._run import Run

FUSED = Finding(
    "fused_gelus",
    "GELU(s)",
    "{}: runs with the GELU after it",
    triton=True,
    doc="the linear layers whose GELU now runs fused with them (``linear_gelu``)",
)


class LinearAct:
    kind = "linear_act"
    helper = staticmethod(linear_act)
    findings = (FUSED,)

    def takes(self, run: Run, module: nn.Module) -> bool:
        if not run.fuses("linear_gelu"):
            return False
        traced = traced_ops(run)
        return not (traced and _traced_by_fx(module, traced))

    def accept(self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]):
        """The linear layers whose GELU, by probe, now runs with them."""
        gelus = []
        for layer_name, act_name in found:
            layer, act = getattr(module, layer_name), getattr(module, act_name)
            kind, form = linear_kind(layer), gelu_form(act)
            if kind is not None and form is not None:
                run.report.on_revert(register_linear_act(layer, kind, act, form))
                gelus.append(f"{path}.{layer_name}")
        return gelus


def traced_ops(run: Run) -> frozenset[str]:
    """The pairs' ops the fx rewrite takes (``linear_gelu``, ``mlp``, where the policy
    names a kernel other than ``torch``): this pattern leaves those pairs to it."""
    return frozenset(op for op in ("linear_gelu", "mlp") if run.named(op) not in (None, "torch"))


def _traced_by_fx(module: nn.Module, ops: frozenset[str]) -> bool:
    from .._rewrite import calls

    return calls(module, ops)


PATTERN = LinearAct()

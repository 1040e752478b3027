"""The gated MLPs' activation keeping gate and up in FP8 for the backward (the policy's
``fp8_activations``). The ``swiglu`` and ``geglu`` ops' ``fp8`` kernels do it per call
(:func:`..._ops.swiglu.run_fp8_kept`). This pattern lists the MLPs it acts on, and
refuses the option before anything changes where it could not act.

Refused, with the reason: without an FP8 precision (which puts the ``fp8`` kernels first
in ``auto``'s order), or on a device without FP8. Under ``strict`` a refusal raises
(``PolicyError``, ``BackendUnavailableError``). Otherwise the report says why, and the
activations keep their inputs as they are."""

from __future__ import annotations

from .._report import Finding
from .._run import Run
from .fp8_base import fp8_option_enabled, fp8_option_refusal
from .gated_mlp import GEGLUS, SWIGLUS

KEPT = Finding(
    "fp8_activations",
    "gated activations' gate and up in FP8",
    "{}: its activation keeps gate and up for the backward in FP8 (e4m3, a scale per row; "
    "not under torch.compile, whose graph keeps what it computes)",
    "kept",
    listed_when_empty=False,
    doc="the gated MLPs whose activation keeps gate and up for the backward in FP8 (``fp8_activations``), where the policy leaves the activation's kernel to ``auto``",
)  # fmt: skip
_OTHERS = ("fused", "torch")  # the activations' kernels that keep gate and up as they are
_NEEDS = "its FP8 kernels run first under an FP8 precision, not under precision={!r}"


class Fp8Activations:
    findings = (KEPT,)

    def enabled(self, run: Run) -> bool:
        """Whether the option is on; asked before any pattern runs, so that a refusal
        under ``strict`` raises with the model untouched."""
        return fp8_option_enabled(run, "fp8_activations", _NEEDS)

    def apply_model(self, run: Run) -> None:
        why = fp8_option_refusal(run, "fp8_activations", _NEEDS)
        if why is not None:
            run.skip("<model>", f"fp8_activations: {why}; gate and up kept as they are")
            return
        kept = [
            path
            for finding, op in ((SWIGLUS, "swiglu"), (GEGLUS, "geglu"))
            if run.policy.get(op) not in _OTHERS
            for path in getattr(run.report, finding.field)
        ]
        named = [op for op in ("swiglu", "geglu") if run.policy.get(op) in _OTHERS]
        if named:
            run.skip("<model>", f"fp8_activations: the policy names the kernel of "
                     f"{' and '.join(named)}, which then keeps gate and up as they are")  # fmt: skip
        run.report.add(KEPT, kept)


PATTERN = Fp8Activations()

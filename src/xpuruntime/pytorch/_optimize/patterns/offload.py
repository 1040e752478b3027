"""Activation offload (the policy's ``offload_activations``): every layer whose gradient
checkpointing transformers turned on (``model.gradient_checkpointing_enable()``, before
``optimize``) checkpoints through one
:class:`~..._functional._offload.ActivationOffload` of the model, its input waiting in
pinned host memory between its forward and its backward."""

from __future__ import annotations

from .._report import Finding
from .._run import Run

OFFLOADED = Finding(
    "offloaded_checkpoints",
    "checkpointed layer input(s) to pinned host memory",
    "{}: its checkpointed input waits in pinned host memory from its forward to its "
    "backward (copied on a side stream, brought back during the next layer's backward)",
    verb="offloaded",
    listed_when_empty=False,
    doc="checkpointed layers whose input waits in pinned host memory (``offload_activations``)",
)
_FUNCTION = "_gradient_checkpointing_func"  # what transformers' checkpointed layers call


class Offload:
    findings = (OFFLOADED,)

    def enabled(self, run: Run) -> bool:
        return run.policy is not None and run.policy.offload_activations

    def apply_model(self, run: Run) -> None:
        from ..._functional._offload import ActivationOffload

        layers = [
            (path, module)
            for path, module in run.decoder_layers()
            if getattr(module, "gradient_checkpointing", False) is True
            and callable(module.__dict__.get(_FUNCTION))
        ]
        if not layers:
            run.skip("<model>", "offload_activations: no layer has gradient checkpointing on "
                     "(call model.gradient_checkpointing_enable() before optimize)")  # fmt: skip
            return
        offload = ActivationOffload()
        for _, module in layers:
            written = module.__dict__[_FUNCTION]
            module.__dict__[_FUNCTION] = offload
            run.report.on_revert(lambda m=module, w=written: m.__dict__.__setitem__(_FUNCTION, w))
        run.report.add(OFFLOADED, [path for path, _ in layers])


PATTERN = Offload()

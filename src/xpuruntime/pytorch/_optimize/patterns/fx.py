"""The ``torch.fx`` rewrite (:mod:`.._rewrite`), over the whole model after the module
patterns, for the ops a policy names there (not ``torch``): a forward that computes
``norm(a + b)`` and uses the sum again runs the add and the norm as the
``residual_layernorm`` op; one that feeds a linear layer's output to a GELU alone, the
``linear_gelu`` op; one that feeds it on to a second linear layer alone, the ``mlp`` op
(tried before ``linear_gelu``). A torch.compile'd model is not rewritten, and the report
says why."""

from __future__ import annotations

from .._report import Finding
from .._run import Run
from . import linear_act, residual

MLPS = Finding(
    "fused_mlps",
    "MLP(s)",
    "{}: runs with its MLP's GELU and second layer",
    triton=True,
    doc="the first linear layers of MLPs (linear, GELU, linear) that now run as one op (``mlp``)",
)

_COMPILED_NOT_REWRITTEN = (
    "not fused: the model is already torch.compile'd, so its forwards are left as "
    "written; optimize the eager model and compile it after (make_train_step(..., "
    "compile_model=True) does both)"
)


class FxRewrite:
    findings = (MLPS,)

    def enabled(self, run: Run) -> bool:
        return run.policy is not None

    def apply_model(self, run: Run) -> None:
        from .._rewrite import REWRITTEN_OPS, rewrite_forwards

        ops = [op for op in REWRITTEN_OPS if run.named(op) not in (None, "torch")]
        if ops and hasattr(run.model, "_orig_mod"):  # torch.compile's wrapper
            run.skip("<model>", f"{' and '.join(ops)} {_COMPILED_NOT_REWRITTEN}")
        elif ops:
            fused, skipped, undo = rewrite_forwards(run.model, ops, run.chosen)
            run.report.on_revert(undo)
            run.report.add(residual.FUSED, fused.get("residual_layernorm", []))
            run.report.add(linear_act.FUSED, fused.get("linear_gelu", []))
            run.report.add(MLPS, fused.get("mlp", []))
            run.report.skipped += skipped


PATTERN = FxRewrite()

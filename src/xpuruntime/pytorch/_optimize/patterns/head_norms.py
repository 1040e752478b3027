"""An attention's per-head q/k norms with its rotary embedding (``q = self.q_norm(...)``,
``k = self.k_norm(...)``, then ``apply_rotary_pos_emb(q, k, cos, sin)``: Qwen3's and
Gemma3's) as one op, ``rmsnorm_rope`` (:func:`.._functional._norm_rope.head_norms_rope`),
where the policy fuses the norms and the rope."""

from __future__ import annotations

from torch import nn

from ... import nn as routed
from ..._functional._norm_rope import head_norms_rope
from .._report import Finding
from .._run import Run

FUSED = Finding(
    "fused_head_norms",
    "per-head norm pair(s)",
    "{}: its q/k norms run with the rotary embedding as one op",
    triton=True,
    doc="the attention modules whose per-head q/k norms run with the rotary embedding (``rmsnorm_rope``)",
)


class HeadNorms:
    kind = "head_norms"  # the statement engine's kind
    helper = staticmethod(head_norms_rope)
    findings = (FUSED,)

    def takes(self, run: Run, module: nn.Module) -> bool:
        return all(run.fuses(op) for op in ("rmsnorm_rope", "rmsnorm", "rope"))

    def accept(self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]):
        """The norm pairs the op can take: our RMSNorm (or one it will be) of a 1-D
        weight, each."""
        return [
            f"{path}.{q}+{k}"
            for q, k in found
            if all(_head_norm(getattr(module, n), run) for n in (q, k))
        ]


def _head_norm(module: nn.Module, run: Run) -> bool:
    """Whether ``module`` is our RMSNorm over one dim, or an RMSNorm of a 1-D weight
    that the swaps will make one."""
    if isinstance(module, routed.RMSNorm):
        return len(tuple(module.normalized_shape)) == 1
    weight = getattr(module, "weight", None)
    match = run.norm_match(module)
    return match is not None and match[0] is not None and weight is not None and weight.dim() == 1


PATTERN = HeadNorms()

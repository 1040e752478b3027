"""Module swaps: ``nn.LayerNorm`` becomes :class:`xpt.nn.LayerNorm`, ``nn.RMSNorm`` and
any module that computes an RMSNorm whatever its class (a leaf holding a 1-D ``weight``
and a float epsilon, compared with the formula on probe inputs; Gemma's ``(1 + weight)``
form with ``weight_offset=1``) :class:`xpt.nn.RMSNorm`, and, where the policy names a
``linear`` kernel, ``nn.Linear`` :class:`xpt.nn.Linear`. Look-alikes that compute
something else, subclasses that override the forward and ``nn.MultiheadAttention`` are
listed in ``skipped`` with why."""

from __future__ import annotations

from torch import nn

from ... import nn as routed
from .._run import Run
from .residual import own_forward


class Swaps:
    findings = ()

    def enabled(self, run: Run) -> bool:
        return True

    def apply(self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module) -> bool:
        kind = type(module).__name__
        if isinstance(module, (routed.LayerNorm, routed.RMSNorm, routed.Linear)):
            return True
        linears = run.policy is not None and run.policy.get("linear") is not None
        if type(module) is nn.Linear and linears:
            new: nn.Module = routed.Linear.from_linear(module)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and own_forward(module):
            norm = "LayerNorm" if isinstance(module, nn.LayerNorm) else "RMSNorm"
            run.skip(
                path, f"{kind} overrides the forward of {norm}; its computation is left as written"
            )
            return True
        elif isinstance(module, nn.LayerNorm):
            new = routed.LayerNorm.from_layernorm(module)
        elif isinstance(module, nn.RMSNorm):
            new = routed.RMSNorm.from_module(module)
        elif (match := run.norm_match(module)) is not None:
            eps, why, offset = match
            if eps is None:
                run.skip(path, f"{kind} {why}")
                return True
            new = routed.RMSNorm.from_module(module, eps=eps, weight_offset=offset)
        elif "Norm" in kind:
            run.skip(path, f"{kind}: only LayerNorm and RMSNorm kinds are replaced")
            return True
        elif isinstance(module, nn.MultiheadAttention):
            run.skip(
                path,
                "nn.MultiheadAttention runs PyTorch's attention kernels itself; its SDPA call "
                "follows the policy's switches",
            )
            return True
        else:
            return False
        run.swap(path, parent, name, new, kind, f"xpt.nn.{type(new).__name__}")
        return True


PATTERN = Swaps()

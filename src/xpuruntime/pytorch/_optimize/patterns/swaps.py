"""Module swaps: ``nn.LayerNorm`` becomes :class:`xpt.nn.LayerNorm`, ``nn.RMSNorm`` and
any module that computes an RMSNorm whatever its class (a leaf holding a 1-D ``weight``
and a float epsilon, compared with the formula on probe inputs; Gemma's ``(1 + weight)``
form with ``weight_offset=1``) :class:`xpt.nn.RMSNorm`, and, where the policy names a
``linear`` kernel, ``nn.Linear`` :class:`xpt.nn.Linear` (so too, under
``precision="fp8"``, each whose weight is large enough for FP8 to pay, on a GPU with FP8:
its GEMMs then run FP8 per call where the tokens are enough). Look-alikes that compute
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
        if type(module) is nn.Linear and (linears or _fp8_pays(run, module)):
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


def _fp8_pays(run: Run, layer: nn.Linear) -> bool:
    """Under an FP8 precision, whether ``layer``'s GEMMs may run FP8: its weight at least
    the stated table's, on a device with FP8 (the tokens are the call's to decide)."""
    from ..._kernels.fp8 import FP8_MIN_WEIGHT, PRECISIONS, fp8_refusal

    if run.policy is None or run.policy.precision not in PRECISIONS:
        return False
    if id(layer) in run.joined:  # its GEMMs are the op's that runs it (FP8 there too)
        return False

    weight = layer.weight
    return weight.numel() >= FP8_MIN_WEIGHT and fp8_refusal(weight.device) is None


PATTERN = Swaps()

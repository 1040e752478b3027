"""The public ops: our kernels called directly, as functions, outside any policy.

The Triton ops (``fused_layernorm``, ``fused_rmsnorm``, ``fused_add_layernorm``,
``fused_add_rmsnorm``, ``fused_linear``, ``fused_linear_gelu``,
``fused_linear_cross_entropy``, ``fused_mlp``, ``swiglu``, ``geglu``, ``rope``) need
Triton (``fused_mlp`` nvmath-python too); where it is not installed, using one raises
:class:`~xpuruntime.BackendUnavailableError` naming what is missing, and the rest works.
``fused_attention`` is the policy-routed attention (the seed documents'
``ops.fused_attention``); ``FusedLayerNorm``, ``FusedRMSNorm`` and ``FusedLinear`` are
the drop-in modules' former names (:mod:`xpuruntime.pytorch.nn`). The ops themselves
live in ``_ops/``, the package's floor.
"""

import importlib.util

from .._errors import BackendUnavailableError
from ._functional._attention import fused_attention
from .nn import FusedLayerNorm, FusedLinear, FusedRMSNorm

__all__ = [
    "FusedLayerNorm",
    "FusedLinear",
    "FusedRMSNorm",
    "fused_add_layernorm",
    "fused_add_rmsnorm",
    "fused_attention",
    "fused_layernorm",
    "fused_linear",
    "fused_linear_cross_entropy",
    "fused_linear_gelu",
    "fused_mlp",
    "fused_rmsnorm",
    "geglu",
    "rope",
    "swiglu",
]

TRITON_OPS = (
    "fused_add_layernorm",
    "fused_add_rmsnorm",
    "fused_layernorm",
    "fused_linear",
    "fused_linear_cross_entropy",
    "fused_linear_gelu",
    "fused_mlp",
    "fused_rmsnorm",
    "geglu",
    "rope",
    "swiglu",
)
"""The public ops that run our Triton kernels."""

if importlib.util.find_spec("triton") is not None:
    from ._ops.fused_add_layernorm import fused_add_layernorm
    from ._ops.fused_add_rmsnorm import fused_add_rmsnorm
    from ._ops.fused_layernorm import fused_layernorm
    from ._ops.fused_linear import fused_linear, fused_linear_gelu
    from ._ops.fused_linear_cross_entropy import fused_linear_cross_entropy
    from ._ops.fused_mlp import fused_mlp
    from ._ops.fused_rmsnorm import fused_rmsnorm
    from ._ops.rope import rope
    from ._ops.swiglu import geglu, swiglu
else:

    def __getattr__(name: str):
        if name in TRITON_OPS:
            raise BackendUnavailableError(
                f"xpuruntime.pytorch.ops.{name} runs Triton kernels and Triton is not "
                "installed: pip install triton"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

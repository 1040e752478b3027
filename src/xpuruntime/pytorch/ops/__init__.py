"""Ops whose kernel the policy chooses (one op per module).

``fused_attention`` needs only PyTorch. The Triton ops (``fused_layernorm``,
``fused_rmsnorm``, ``fused_add_layernorm``, ``fused_linear``, ``fused_linear_gelu``,
``fused_mlp`` and their modules) need Triton (``fused_mlp`` nvmath-python too); where it is not installed, using them raises
:class:`~xpuruntime.BackendUnavailableError` naming what is missing, and the rest of this
package works.
"""

import importlib.util

from ..._errors import BackendUnavailableError
from .fused_attention import fused_attention

__all__ = [
    "FusedLayerNorm",
    "FusedLinear",
    "FusedRMSNorm",
    "fused_add_layernorm",
    "fused_attention",
    "fused_layernorm",
    "fused_linear",
    "fused_linear_cross_entropy",
    "fused_linear_gelu",
    "fused_mlp",
    "fused_rmsnorm",
]

_TRITON_OPS = (
    "FusedLayerNorm",
    "FusedLinear",
    "FusedRMSNorm",
    "fused_add_layernorm",
    "fused_layernorm",
    "fused_linear",
    "fused_linear_cross_entropy",
    "fused_linear_gelu",
    "fused_mlp",
    "fused_rmsnorm",
)

if importlib.util.find_spec("triton") is not None:
    from .fused_add_layernorm import fused_add_layernorm
    from .fused_layernorm import FusedLayerNorm, fused_layernorm
    from .fused_linear import FusedLinear, fused_linear, fused_linear_gelu
    from .fused_linear_cross_entropy import fused_linear_cross_entropy
    from .fused_mlp import fused_mlp
    from .fused_rmsnorm import FusedRMSNorm, fused_rmsnorm
else:

    def __getattr__(name: str):
        if name in _TRITON_OPS:
            raise BackendUnavailableError(
                f"xpuruntime.pytorch.ops.{name} runs Triton kernels and Triton is not "
                "installed: pip install triton"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

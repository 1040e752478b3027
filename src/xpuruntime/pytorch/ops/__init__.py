"""Our kernels as PyTorch ops (one op per module): the floor of ``xpuruntime.pytorch``,
importing nothing from the package above it.

The Triton ops (``fused_layernorm``, ``fused_rmsnorm``, ``fused_add_layernorm``,
``fused_add_rmsnorm``, ``fused_linear``, ``fused_linear_gelu``, ``fused_linear_cross_entropy``, ``fused_mlp``,
``swiglu``, ``geglu``, ``rope``)
need Triton (``fused_mlp`` nvmath-python too); where it is not installed, using them
raises :class:`~xpuruntime.BackendUnavailableError` naming what is missing, and the rest
of this package works. The policy-routed ``fused_attention`` (the seed documents'
``ops.fused_attention``) and the drop-in modules' former names ``FusedLayerNorm``,
``FusedRMSNorm`` and ``FusedLinear`` live above this floor (``xpuruntime.pytorch``'s
``_attention`` and ``nn``); importing ``xpuruntime.pytorch``, which every import of this
package does first, sets them here.
"""

import importlib.util

from ..._errors import BackendUnavailableError

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

_TRITON_OPS = (
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

if importlib.util.find_spec("triton") is not None:
    from .fused_add_layernorm import fused_add_layernorm
    from .fused_add_rmsnorm import fused_add_rmsnorm
    from .fused_layernorm import fused_layernorm
    from .fused_linear import fused_linear, fused_linear_gelu
    from .fused_linear_cross_entropy import fused_linear_cross_entropy
    from .fused_mlp import fused_mlp
    from .fused_rmsnorm import fused_rmsnorm
    from .rope import rope
    from .swiglu import geglu, swiglu
else:

    def __getattr__(name: str):
        if name in _TRITON_OPS:
            raise BackendUnavailableError(
                f"xpuruntime.pytorch.ops.{name} runs Triton kernels and Triton is not "
                "installed: pip install triton"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

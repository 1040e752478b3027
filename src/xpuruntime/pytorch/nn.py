"""Drop-in modules whose kernel the policy picks: :class:`LayerNorm`, :class:`RMSNorm`
and :class:`Linear`, each a subclass of PyTorch's module with the same constructor,
parameters and ``state_dict``, calling the policy's routed op (``layernorm``,
``rmsnorm``, ``linear``) in its forward. :func:`~xpuruntime.pytorch.optimize` puts them
in place of PyTorch's modules. ``FusedLayerNorm``, ``FusedRMSNorm`` and ``FusedLinear``
(also found as ``xpuruntime.pytorch.ops.Fused*``) are their former names.
"""

from ._functional._modules import (
    FusedLayerNorm,
    FusedLinear,
    FusedRMSNorm,
    LayerNorm,
    Linear,
    RMSNorm,
)

__all__ = ["FusedLayerNorm", "FusedLinear", "FusedRMSNorm", "LayerNorm", "Linear", "RMSNorm"]

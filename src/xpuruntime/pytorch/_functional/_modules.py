"""Drop-in modules whose kernel the policy picks (public as :mod:`xpuruntime.pytorch.nn`): :class:`LayerNorm`, :class:`RMSNorm`
and :class:`Linear`, each a subclass of PyTorch's module with the same constructor,
parameters and ``state_dict``, calling the policy's routed op (``layernorm``,
``rmsnorm``, ``linear``) in its forward. :func:`~xpuruntime.pytorch.optimize` puts them
in place of PyTorch's modules. ``FusedLayerNorm``, ``FusedRMSNorm`` and ``FusedLinear``
(also found as ``xpuruntime.pytorch.ops.Fused*``) are their former names.
"""

from __future__ import annotations

from torch import Tensor, nn

from .._ops._infra._frozen_casts import frozen_scale
from ._linear import linear
from ._norms import layer_norm, rms_norm

__all__ = ["FusedLayerNorm", "FusedLinear", "FusedRMSNorm", "LayerNorm", "Linear", "RMSNorm"]


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose kernel the policy's ``layernorm`` op picks.

    Each forward's call signature is resolved once through the dispatcher: ``fused``
    runs :func:`~xpuruntime.pytorch.ops.fused_layernorm`, ``torch`` runs
    ``F.layer_norm``, ``auto`` picks (measuring both under ``best_performance``).
    Without a policy this is ``auto``.

    Examples
    --------
    >>> norm = LayerNorm(768).cuda()                             # doctest: +SKIP
    >>> norm.load_state_dict(nn.LayerNorm(768).state_dict())     # doctest: +SKIP
    """

    @classmethod
    def from_layernorm(cls, module: nn.LayerNorm) -> LayerNorm:
        """A LayerNorm sharing ``module``'s parameters (no copy)."""
        return share(cls, module)

    def forward(self, input: Tensor) -> Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose kernel the policy's ``rmsnorm`` op picks: ``fused`` runs
    :func:`~xpuruntime.pytorch.ops.fused_rmsnorm`, ``torch`` runs ``F.rms_norm``,
    ``auto`` picks.

    Examples
    --------
    >>> norm = RMSNorm(4096, eps=1e-6).cuda()              # doctest: +SKIP
    """

    weight_offset: float = 0.0
    """Scale by ``weight_offset + weight`` (computed in fp32): 1 for Gemma's norms, whose
    weights start at zero."""

    @classmethod
    def from_module(
        cls, module: nn.Module, eps: float | None = None, weight_offset: float = 0.0
    ) -> RMSNorm:
        """An RMSNorm sharing ``module``'s weight (an ``nn.RMSNorm``, or any RMSNorm
        with a 1-D ``weight`` and an ``eps`` or ``variance_epsilon``), scaling by
        ``weight_offset + weight``."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        weight = getattr(module, "weight", None)
        new.normalized_shape = tuple(getattr(module, "normalized_shape", weight.shape))
        new.eps = eps if eps is not None else getattr(module, "eps", None)
        new.elementwise_affine = weight is not None
        new.register_parameter("weight", weight)
        if weight_offset:
            new.weight_offset = float(weight_offset)
        return new

    def forward(self, input: Tensor) -> Tensor:
        weight = frozen_scale(self.weight, self.weight_offset)  # (a frozen one's kept)
        return rms_norm(input, self.normalized_shape, weight, self.eps)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return f"{text}, weight_offset={self.weight_offset:g}" if self.weight_offset else text


class Linear(nn.Linear):
    """``nn.Linear`` whose kernel the policy's ``linear`` op picks: ``fused`` runs
    :func:`~xpuruntime.pytorch.ops.fused_linear`, ``torch`` runs ``F.linear``, ``auto``
    picks (measuring both under ``best_performance``).

    Examples
    --------
    >>> layer = Linear.from_linear(model.fc)        # doctest: +SKIP
    """

    @classmethod
    def from_linear(cls, module: nn.Linear) -> Linear:
        """A Linear sharing ``module``'s parameters (no copy)."""
        return share(cls, module)

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)


FusedLayerNorm = LayerNorm
FusedRMSNorm = RMSNorm
FusedLinear = Linear

# Pickles of a model holding them name the public module, not this private one.
for _cls in (LayerNorm, RMSNorm, Linear):
    _cls.__module__ = "xpuruntime.pytorch.nn"


def share(cls: type, module: nn.Module):
    """An instance of ``cls`` (a subclass of ``module``'s class) holding ``module``'s
    Parameter objects in fresh containers: the two share weights but not their
    registries of parameters, buffers and hooks."""
    new = cls.__new__(cls)
    new.__dict__.update(
        {k: v.copy() if isinstance(v, dict) else v for k, v in module.__dict__.items()}
    )
    return new

"""Which layers the patterns may treat as a linear layer: the one seam between a model's
layers and the fusions that read their weights (joined projections, a gated MLP's gate,
up and down, a LoRA adapter's base), so that a layer wrapped by someone else is judged
in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LinearView", "linear_view"]


@dataclass(frozen=True)
class LinearView:
    """A layer seen as a linear layer: the plain ``nn.Linear`` it computes with (``base``)
    and the module around it that adds a term per call (``wrapper``: peft's
    ``lora.Linear``), or None where it computes the base alone."""

    base: nn.Module  # nn.Linear, or bitsandbytes' Linear4bit
    wrapper: nn.Module | None = None

    @property
    def plain(self) -> bool:
        """Whether the layer computes its base alone (whose weights may then be joined)."""
        return self.wrapper is None

    @property
    def dense(self) -> bool:
        """Whether the layer is a plain ``nn.Linear`` (not a 4-bit one, alone or wrapped)."""
        return self.wrapper is None and type(self.base) is nn.Linear

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the base computes in (a 4-bit base's: what it dequantizes to)."""
        from ._ops.lora_linear import weight_dtype

        return weight_dtype(self.base.weight)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features


def linear_view(layer: object) -> LinearView | None:
    """``layer`` as a linear layer, or None where it is none: a plain ``nn.Linear`` (not
    a subclass, such as our routed Linear) or bitsandbytes' quantized ``Linear4bit``
    (a QLoRA base peft left without an adapter), or a wrapper holding one as
    ``base_layer`` with LoRA adapters (``lora_A`` / ``lora_B`` module dicts and a
    ``scaling`` table, as peft's ``lora.Linear`` has, whatever its class), whose per-call term
    :func:`~._lora.lora_term` reads. Under such a wrapper the base may also be
    bitsandbytes' ``Linear4bit`` (QLoRA), whose weight the LoRA op dequantizes.

    Examples
    --------
    >>> linear_view(nn.Linear(4, 8)).plain, linear_view(nn.ReLU())
    (True, None)
    """
    if type(layer) is nn.Linear or _four_bit(layer):
        return LinearView(layer)
    base = getattr(layer, "base_layer", None)
    if (
        isinstance(layer, nn.Module)
        and (type(base) is nn.Linear or _four_bit(base))
        and isinstance(getattr(layer, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(layer, "lora_B", None), nn.ModuleDict)
        and isinstance(getattr(layer, "scaling", None), dict)
    ):
        return LinearView(base, layer)
    return None


def _four_bit(module: object) -> bool:
    """bitsandbytes' ``Linear4bit`` with its weight quantized (not a subclass)."""
    kind = type(module)
    return (
        kind.__name__ == "Linear4bit"
        and kind.__module__.startswith("bitsandbytes.")
        and getattr(getattr(module, "weight", None), "bnb_quantized", False)
    )

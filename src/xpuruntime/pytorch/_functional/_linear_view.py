"""Which layers the patterns may treat as a linear layer: the one seam between a model's
layers and the fusions that read their weights (joined projections, a gated MLP's gate,
up and down), so that a layer wrapped by someone else is judged in one place."""

from __future__ import annotations

from torch import nn

__all__ = ["linear_view"]


def linear_view(layer: object) -> nn.Linear | None:
    """The plain ``nn.Linear`` whose weight and bias ``layer`` computes with, and nothing
    else per call; None where it computes something else or more (a subclass such as our
    routed Linear, a wrapper such as peft's ``lora.Linear``, which adds its adapter's
    term: a pattern for such layers describes what they add here, and the patterns that
    read weights then see them).

    Examples
    --------
    >>> linear_view(nn.Linear(4, 8)) is not None, linear_view(nn.ReLU())
    (True, None)
    """
    return layer if type(layer) is nn.Linear else None

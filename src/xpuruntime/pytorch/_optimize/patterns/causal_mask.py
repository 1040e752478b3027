"""Causal masks under ``torch.compile``: a model whose forward builds its full-attention
mask with transformers' ``create_causal_mask`` calls, in its place, one that returns None
while dynamo traces where transformers returns None in eager: the mask would be plain
causal (no padding mask, no extra mask functions, no tokens cached before these, no
packed sequences to look for), so SDPA runs with ``is_causal`` on its fast kernels.

Before torch 2.14 transformers never leaves the mask out while compiling (dynamo folds
``torch.compiler.is_exporting()`` to True, which transformers reads as an export), so a
compiled model hands SDPA a materialised (batch, 1, T, T) mask: on the Llama-3.2-1B shape
at T2048 on an H100, cuDNN's attention backward then takes 23 ms per step instead of 8.
Outside a trace, and in every other case, transformers' own function decides."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._recognise import called_function
from .._report import Finding
from .._run import Run

FUNCTION = "create_causal_mask"
LEFT = Finding(
    "causal_masks_left_to_sdpa",
    "causal mask(s) to SDPA's is_causal under torch.compile",
    "{}: under torch.compile its plain causal mask is left to SDPA's is_causal, as "
    "transformers leaves it in eager",
    verb="left",
    listed_when_empty=False,
)
# The arguments the decision reads; any other one given (or one not None) is left to
# transformers.
_READ = frozenset({"config", "inputs_embeds", "attention_mask", "cache", "position_ids"})
_NONE = ("or_mask_function", "and_mask_function", "block_sequence_ids", "layer_idx")
_KNOWN = _READ | set(_NONE) | {"allow_is_causal_skip"}


class CausalMask:
    finding = LEFT

    def match(self, run: Run, path: str, module: nn.Module) -> Callable[..., Any] | None:
        """What ``module``'s forward is to call as ``create_causal_mask``, or None."""
        original = called_function(module, FUNCTION)
        if getattr(original, "__module__", "") != "transformers.masking_utils":
            return None
        return _left_to_sdpa(original)


@functools.cache
def _left_to_sdpa(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (transformers' ``create_causal_mask``), except that while dynamo
    traces it returns None where the mask would be plain causal (see the module's
    text). One per original function."""
    from transformers.cache_utils import DynamicCache

    names = tuple(inspect.signature(original).parameters)

    def create_causal_mask(*args: Any, **kwargs: Any):
        if torch.compiler.is_compiling():
            given = dict(zip(names, args))
            given.update(kwargs)
            if _plain_causal(given, DynamicCache):
                return None
        return original(*args, **kwargs)

    create_causal_mask.__wrapped__ = original  # type: ignore[attr-defined]
    return create_causal_mask


def _plain_causal(given: dict[str, Any], dynamic: type) -> bool:
    """Whether transformers would return None in eager for these arguments, decided
    without reading a tensor's values."""
    if any(given.get(name) is not None for name in _NONE):
        return False
    if given.get("allow_is_causal_skip", True) is not True:
        return False
    if not _KNOWN.issuperset(given):
        return False
    config, embeds = given.get("config"), given.get("inputs_embeds")
    if (
        not isinstance(embeds, torch.Tensor)
        or embeds.dim() != 3
        or not getattr(config, "is_causal", True)
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or given.get("attention_mask") is not None
    ):
        return False
    cache = given.get("cache")
    if cache is None:
        # transformers looks for packed sequences in the positions, reading their values
        return given.get("position_ids") is None
    return (
        isinstance(cache, dynamic)
        and not getattr(cache, "is_compileable", False)
        and cache.get_seq_length() == 0
    )


PATTERN = CausalMask()

"""Causal masks: a model whose forward builds its full-attention mask with transformers'
``create_causal_mask`` calls, in its place, one that

- under ``torch.compile`` returns None while dynamo traces where transformers returns
  None in eager: the mask would be plain causal (no padding mask, no extra mask
  functions, no tokens cached before these, no packed sequences to look for), so SDPA
  runs with ``is_causal`` on its fast kernels;
- in eager, for a packed batch (positions restarting per document, no padding mask, no
  cache: TRL's padding-free rows), returns the mask as its documents
  (:class:`~..._functional._documents.DocumentMask`), on which SDPA runs our Triton
  kernel within each document; transformers' own mask is built where anything else
  reads it. Only where the policy leaves ``attention`` to auto or names ``triton``.

Before torch 2.14 transformers never leaves the mask out while compiling (dynamo folds
``torch.compiler.is_exporting()`` to True, which transformers reads as an export), so a
compiled model hands SDPA a materialised (batch, 1, T, T) mask: on the Llama-3.2-1B shape
at T2048 on an H100, cuDNN's attention backward then takes 23 ms per step instead of 8.
In every other case transformers' own function decides."""

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
DOCUMENTS = Finding(
    "packed_masks_as_documents",
    "packed-sequence mask(s) to our document attention",
    "{}: a packed batch's block-diagonal causal mask (positions restarting per document, "
    "use_cache off) is kept as its documents: SDPA on it runs our Triton kernel within "
    "each document where the kernel takes the call, on transformers' mask elsewhere",
    verb="left",
    listed_when_empty=False,
)
# The arguments the decision reads; any other one given (or one not None) is left to
# transformers.
_READ = frozenset({"config", "inputs_embeds", "attention_mask", "cache", "position_ids"})
_NONE = ("or_mask_function", "and_mask_function", "block_sequence_ids", "layer_idx")
_KNOWN = _READ | set(_NONE) | {"allow_is_causal_skip"}


class CausalMask:
    def match(self, run: Run, path: str, module: nn.Module) -> Callable[..., Any] | None:
        """What ``module``'s forward is to call as ``create_causal_mask``, or None."""
        original = called_function(module, FUNCTION)
        if getattr(original, "__module__", "") != "transformers.masking_utils":
            return None
        return _left_to_sdpa(original, self.documents(run))

    def findings(self, run: Run) -> tuple[Finding, ...]:
        """What binding the function means under ``run``'s policy."""
        return (LEFT, DOCUMENTS) if self.documents(run) else (LEFT,)

    @staticmethod
    def documents(run: Run) -> bool:
        """Whether packed batches' masks are kept as documents: our kernel is there to
        read them, and the policy leaves attention to it or to auto."""
        return run.triton and run.named("attention") in (None, "triton")


@functools.cache
def _left_to_sdpa(original: Callable[..., Any], documents: bool = False) -> Callable[..., Any]:
    """``original`` (transformers' ``create_causal_mask``), except that while dynamo
    traces it returns None where the mask would be plain causal, and with ``documents``
    a packed batch's mask is a :class:`DocumentMask` (see the module's text). One per
    original function and ``documents``."""
    from transformers.cache_utils import DynamicCache

    from ..._functional._documents import DocumentMask

    names = tuple(inspect.signature(original).parameters)

    def create_causal_mask(*args: Any, **kwargs: Any):
        compiling = torch.compiler.is_compiling()
        if compiling or documents:
            given = dict(zip(names, args))
            given.update(kwargs)
            if "past_key_values" in given:  # the cache's name up to transformers 5.17 at least
                given["cache"] = given.pop("past_key_values")
            if compiling and _plain_causal(given, DynamicCache):
                return None
            packed = None if compiling else _packed(given)
            if packed is not None:
                return DocumentMask(packed, lambda: original(*args, **kwargs))
        return original(*args, **kwargs)

    create_causal_mask.__wrapped__ = original  # type: ignore[attr-defined]
    return create_causal_mask


def _causal_sdpa(given: dict[str, Any]) -> bool:
    """Whether these arguments ask for a causal mask for SDPA and nothing else: no
    padding mask, no mask functions or overlays, no argument this module does not know."""
    if any(given.get(name) is not None for name in _NONE):
        return False
    if not _KNOWN.issuperset(given):
        return False
    config, embeds = given.get("config"), given.get("inputs_embeds")
    return (
        isinstance(embeds, torch.Tensor)
        and embeds.dim() == 3
        and getattr(config, "is_causal", True)
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and given.get("attention_mask") is None
    )


def _packed(given: dict[str, Any]) -> torch.Tensor | None:
    """The (B, T) document ids transformers finds in the positions of a packed batch
    (it looks only without a padding mask or a cache), or None where it would find
    none or the mask asks for more than causal attention within documents."""
    positions = given.get("position_ids")
    if given.get("cache") is not None or not isinstance(positions, torch.Tensor):
        return None
    if not _causal_sdpa(given) or positions.dim() != 2:
        return None
    from transformers.masking_utils import find_packed_sequence_indices

    embeds = given["inputs_embeds"]
    if positions.shape[1] != embeds.shape[1]:
        return None
    return find_packed_sequence_indices(positions.expand(embeds.shape[0], -1))


def _plain_causal(given: dict[str, Any], dynamic: type) -> bool:
    """Whether transformers would return None in eager for these arguments, decided
    without reading a tensor's values."""
    if given.get("allow_is_causal_skip", True) is not True or not _causal_sdpa(given):
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

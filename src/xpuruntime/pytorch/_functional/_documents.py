"""Packed sequences' attention masks kept as their documents.

A packed batch (TRL's padding-free rows: several documents per row, positions restarting
at each) has transformers build a (B, 1, T, T) block-diagonal causal mask, which SDPA
then reads in full: over one 8192-token row of 16 documents, every query against every
key. :class:`DocumentMask` stands where that mask would: it carries the documents (the
ids transformers finds in the positions) and, given to ``F.scaled_dot_product_attention``
where our Triton kernel takes the call, runs it within each document alone
(:func:`~..ops.flash_attention.attention` with ``documents``): a sixteenth of the work
for 16 documents of 512. Anything else that reads the mask gets transformers' own, built
then (once), so every other use computes exactly what transformers computes. Where SDPA
itself runs on the built mask (the policy in force names another attention kernel, or
ours does not take the inputs), a warning says why, once per reason.

Wherever a mask is given, transformers repeats the key and value heads to the query
heads' count before SDPA (SDPA's fused kernels take grouped heads only without a mask).
For a DocumentMask it now hands SDPA the grouped heads with ``enable_gqa``
(:func:`grouped_heads`). Our kernel reads them as they are: no copies of keys and values,
and no sums of their gradients. A call our kernel does not take gets them repeated before
SDPA runs on the built mask, as transformers would have done."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ._subclasses import METADATA

__all__ = ["DocumentMask", "causal_within", "grouped_heads"]


class DocumentMask(Tensor):
    """The bool (B, 1, T, T) mask of causal attention within each document of ``documents``
    (B, T). With a ``window`` (a sliding-window layer's), each query sees its last
    ``window`` keys at most. ``build()`` makes it only where something other than SDPA on
    our kernel reads it."""

    @staticmethod
    def __new__(cls, documents: Tensor, build: Callable[[], Tensor], window: int | None = None):
        batch, seq = documents.shape
        empty = torch.empty((), device=documents.device, dtype=torch.bool)
        mask = Tensor._make_subclass(cls, empty.expand(batch, 1, seq, seq), False)
        mask._documents, mask._build, mask._built, mask._bounds = documents, build, None, None
        mask._window = window
        return mask

    def __init__(self, *args, **kwargs) -> None:
        pass

    @property
    def documents(self) -> Tensor:
        """(B, T) integer ids, one document per run of equal ids."""
        return self._documents

    @property
    def window(self) -> int | None:
        """The sliding window, the keys each query sees at most (None: no window)."""
        return self._window

    @property
    def bounds(self) -> tuple[Tensor, Tensor]:
        """Each position's (starts, ends) within its document and the window
        (:func:`~..ops.flash_attention.document_bounds`), computed once for every layer
        that reads this mask."""
        if self._bounds is None:
            from .._ops.flash_attention import document_bounds

            self._bounds = document_bounds(self._documents, self._window)
        return self._bounds

    def materialize(self) -> Tensor:
        """transformers' own mask (built on first use, then kept)."""
        if self._built is None:
            self._built = self._build()
        return self._built

    def __repr__(self) -> str:
        return (f"DocumentMask(shape={tuple(self.shape)}, documents={tuple(self._documents.shape)}, "
                f"window={self._window})")  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is Tensor.__getitem__ and _whole(args):
            return args[0]  # transformers' mask[:, :, :, :kv_length] over every key
        if func is F.scaled_dot_product_attention:
            out = _within_documents(*args, **kwargs)
            if not isinstance(out, str):
                return out
            _warn_once(out)
            args, kwargs = _heads_repeated(args, kwargs)
        args, kwargs = _materialized(args), _materialized(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def causal_within(documents: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The bool (B, 1, T, T) mask of causal attention within each document of
    ``documents`` (B, T), each query seeing its ``window`` last keys at most where given,
    as transformers builds it for SDPA, made on the device."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    if window is not None:  # (transformers' sliding_window_overlay: kv > q - window)
        causal = causal.triu(1 - window)
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _heads_repeated(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """SDPA's arguments with grouped key and value heads repeated to the query heads'
    count and ``enable_gqa`` off: what transformers hands SDPA with any other mask (on
    CUDA, a masked SDPA takes grouped heads only on its math kernel)."""
    given = {**dict(zip(_SDPA, args)), **kwargs}
    query, key = given["query"], given["key"]
    if not given.get("enable_gqa") or key.shape[-3] == query.shape[-3]:
        return args, kwargs
    group = query.shape[-3] // key.shape[-3]
    for name in ("key", "value"):
        given[name] = given[name].repeat_interleave(group, dim=-3)
    given["enable_gqa"] = False
    return (), given


def _whole(args: tuple) -> bool:
    """Whether ``mask[index]`` selects all of the mask."""
    mask, index = args[0], args[1]
    index = index if isinstance(index, tuple) else (index,)
    if not isinstance(mask, DocumentMask) or len(index) > mask.dim():
        return False
    for size, part in zip(mask.shape, index):
        if not isinstance(part, slice) or part.step not in (None, 1):
            return False
        if part.indices(size) != (0, size, 1):
            return False
    return True


def _within_documents(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | str:
    """SDPA on our kernel within each document of ``attn_mask``, or why it cannot run
    this call (the mask is then built and SDPA runs on it): the checks
    :func:`~..ops.flash_attention.flash_attention` runs, and the policy in force."""
    from ..._errors import InvalidInputError
    from .._kernels._base import triton_refusal
    from .._ops._infra._attention_inputs import check_attention
    from .._ops.flash_attention import attention, unsupported, unsupported_documents
    from .._selection._policy import current_state

    if not isinstance(attn_mask, DocumentMask):
        return "the documents were not SDPA's attn_mask"
    if dropout_p or is_causal:
        return "SDPA was asked for dropout or is_causal besides the mask"
    try:
        check_attention(query, key, value, None, 0.0)
    except InvalidInputError as error:
        return str(error)
    if key.shape[1] != query.shape[1] and not enable_gqa:
        return "fewer key heads than query heads without enable_gqa"
    policy = current_state().policy
    named = None if policy is None else policy.get("attention")
    if named not in (None, "triton"):
        return f"the kernel policy names attention {named!r}"
    refused = triton_refusal(query.device)
    if refused is not None:
        return refused.reason
    why = unsupported(query, key, value) or unsupported_documents(
        query, key, attn_mask.documents, True
    )
    if why is not None:
        return why
    return attention(query, key, value, True, scale, attn_mask.bounds)


_warned: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        warnings.warn(
            f"packed sequences or a sliding window: SDPA ran on transformers' mask, not "
            f"within each document and window on our kernel: {why}",
            stacklevel=4,
        )


def _materialized(tree):
    """``tree`` with each DocumentMask in it replaced by transformers' mask."""
    return pytree.tree_map_only(DocumentMask, DocumentMask.materialize, tree)


def grouped_heads() -> None:
    """Have transformers' SDPA attention pass grouped key and value heads, with
    ``enable_gqa``, where its mask is a DocumentMask: its ``use_gqa_in_sdpa`` answers
    True for one, and as before for any other mask. Installed once and left in place,
    since it changes nothing for other masks. Without that check in transformers,
    nothing is done."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return
    asks = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if asks is None or getattr(asks, "documents_grouped", False):
        return

    def use_gqa_in_sdpa(attention_mask, *args, **kwargs):
        return isinstance(attention_mask, DocumentMask) or asks(attention_mask, *args, **kwargs)

    use_gqa_in_sdpa.documents_grouped = True  # type: ignore[attr-defined]
    use_gqa_in_sdpa.__wrapped__ = asks  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa

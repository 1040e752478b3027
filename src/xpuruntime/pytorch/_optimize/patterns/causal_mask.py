"""Causal masks and KV caches built without waiting for the GPU. A model whose forward
builds its masks with transformers' ``create_causal_mask`` (and
``create_sliding_window_causal_mask``) calls, in their place, builders that

- under ``torch.compile`` and while a CUDA graph is captured (a graphed training step)
  return None for the full-attention mask, and for the sliding-window one where the
  window takes in every key, where transformers returns None in eager: the mask would
  be plain causal (no padding mask, no extra mask functions, no tokens cached before
  these, no packed sequences to look for), so SDPA runs with ``is_causal`` on its fast
  kernels. transformers itself cannot read the tensors there, so it builds the whole
  mask. Gemma3-1B at T2048 (window 4096): cuDNN's attention took 27 ms a step on the
  22 sliding layers' masks, 10 without. A graphed Llama-3.2-1B LoRA step on an H200:
  cuDNN's attention 30.6 ms with the masks, 11.1 without;
- in eager, for a packed batch (positions restarting per document, no padding mask, no
  cache: TRL's padding-free rows), return the full-attention mask as its documents
  (:class:`~..._functional._documents.DocumentMask`), on which SDPA runs our Triton
  kernel within each document; transformers' own mask is built where anything else
  reads it. Only where the policy leaves ``attention`` to auto or names ``triton``.
  Under the policy's ``packed_sequences`` every batch given positions is read so. Its
  documents are made from the positions on the device, with no host sync a forward,
  and nothing keeps a CUDA graph from capturing packed batches. Where another kernel
  runs attention, SDPA gets the block-diagonal mask made there from the documents;
- in eager and under capture, where our kernel reads documents, for a sliding-window
  layer whose window cuts a plain causal call's keys (no padding: no mask, or one of
  ones; no tokens cached before these), return a DocumentMask of one document a row and
  the window. Our kernel skips the key blocks outside it, where SDPA would read a dense
  (B, 1, T, T) mask over every key. Heads of a size it does not take get transformers'
  mask, as before;
- where the model was called without positions and makes its own (an ``arange``: no
  packed sequences in them), build transformers' masks without handing them those
  positions (the forward is rewritten twice, its builders knowing so or not, and the
  caller's arguments pick one). Without a cache transformers reads the positions' values
  to look for packed sequences, a host sync in every forward: the host can no longer
  queue work ahead of the GPU, which costs a host-bound model most (Gemma3-1B, B4 x T2048
  on an H100, use_cache off: 164-172 ms a step with the syncs, 137-140 without); under
  ``torch.compile``, which cannot read them, the full-attention mask is then left to
  SDPA's ``is_causal`` as in eager, not built.

The forward's ``DynamicCache`` (a cache built in a training forward, ``use_cache`` on)
gets its sliding-window layers' window sizes on the model's device: transformers copies
each from the host in every forward, one sync per sliding layer (22 a step in Gemma3-1B).

Before torch 2.14 transformers never leaves the mask out while compiling (dynamo folds
``torch.compiler.is_exporting()`` to True, which transformers reads as an export), so a
compiled model hands SDPA a materialised (batch, 1, T, T) mask: on the Llama-3.2-1B shape
at T2048 on an H100, cuDNN's attention backward then takes 23 ms per step instead of 8.
In every other case transformers' own functions decide."""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._functional._documents import causal_within as _causal_within
from .._functions import called_function, calling_source
from .._report import Finding
from .._run import Run

FUNCTION = "create_causal_mask"
SLIDING = "create_sliding_window_causal_mask"
CACHE = "DynamicCache"
LEFT = Finding(
    "causal_masks_left_to_sdpa",
    "causal mask(s) to SDPA's is_causal",
    "{}: under torch.compile and CUDA graph capture its plain causal mask (and a "
    "sliding-window one whose window takes in every key) is left to SDPA's is_causal, "
    "as transformers leaves it in eager",
    verb="left",
    listed_when_empty=False,
    when="under torch.compile or graph capture",
    doc="models whose plain causal mask is left to SDPA's ``is_causal`` under torch.compile "
    "and CUDA graph capture",
)
DOCUMENTS = Finding(
    "packed_masks_as_documents",
    "packed-sequence mask(s) to our document attention",
    "{}: a packed batch's block-diagonal causal mask (positions restarting per document, "
    "use_cache off), and a sliding window shorter than the call, are kept as documents "
    "and window: SDPA on them runs our Triton kernel within each document and window "
    "where the kernel takes the call, on transformers' mask elsewhere",
    verb="left",
    listed_when_empty=False,
    triton=True,
    when="for packed batches",
    doc="models whose packed batches' masks are kept as their documents, for our document attention",
)
TRUSTED = Finding(
    "packed_positions_read_on_device",
    "model(s)' positions as packed documents, made on the device",
    "{}: batches given positions are read as packed (the policy's packed_sequences); "
    "their documents are made on the device with no host read, also under graph capture. "
    "Where our document attention does not run, SDPA gets the block-diagonal mask made "
    "from them",
    verb="read",
    listed_when_empty=False,
    doc="models whose packed batches' documents are made on the device without a host "
    "sync (``packed_sequences``)",
)
# The arguments the decision reads; any other one given (or one not None) is left to
# transformers.
_READ = frozenset({"config", "inputs_embeds", "attention_mask", "cache", "position_ids"})
_NONE = ("or_mask_function", "and_mask_function", "block_sequence_ids", "layer_idx")
_KNOWN = _READ | set(_NONE) | {"allow_is_causal_skip"}
SYNCS = Finding(
    "host_syncs_removed",
    "host sync(s) from mask or cache building",
    "{}",
    verb="removed",
    listed_when_empty=False,
    doc="models whose masks and sliding windows are built without waiting for the GPU",
)
# A forward that makes its own positions when called without: consecutive, never packed.
_MAKES_POSITIONS = re.compile(r"position_ids\s*=\s*(torch\.arange|cache_position)")


class CausalMask:
    def match(self, run: Run, path: str, module: nn.Module) -> dict[str, Any] | None:
        """What ``module``'s forward is to call in place of transformers' mask builders
        and cache class (by their global names), or None."""
        names: dict[str, Any] = {}
        for function in (FUNCTION, SLIDING):
            original = called_function(module, function)
            if getattr(original, "__module__", "") == "transformers.masking_utils":
                full = function == FUNCTION
                names[function] = _mask_builder(
                    original, full, self.documents(run), False, self.trusted(run)
                )
        if not names:
            return None
        cache = called_function(module, CACHE)
        if (
            getattr(cache, "__module__", "") == "transformers.cache_utils"
            and _only_called(module, CACHE)
            and _has_windows(cache, getattr(module, "config", None))
        ):
            names[CACHE] = _windows_on_device(cache)
        return names

    findings = (LEFT, DOCUMENTS, TRUSTED, SYNCS)

    def found(self, run: Run, names: dict[str, Any]) -> tuple[Finding, ...]:
        """What binding ``names`` (from :meth:`match`) means under ``run``'s policy."""
        if FUNCTION not in names:
            return ()
        read = (TRUSTED,) if self.trusted(run) else ()
        return (LEFT, DOCUMENTS, *read) if self.documents(run) else (LEFT, *read)

    @staticmethod
    def documents(run: Run) -> bool:
        """Whether packed batches' masks are kept as documents: our kernel is there to
        read them, and the policy leaves attention to it or to auto."""
        return run.triton and run.named("attention") in (None, "triton")

    @staticmethod
    def trusted(run: Run) -> bool:
        """Whether the policy says every batch given positions is packed
        (``packed_sequences``)."""
        return run.policy is not None and run.policy.packed_sequences

    @staticmethod
    def for_own_positions(names: dict[str, Any]) -> dict[str, Any]:
        """``names`` (from :meth:`match`) with builders that know the positions they are
        given are the model's own."""
        return {
            name: _mask_builder(builder.__wrapped__, *builder.kind, True)
            for name, builder in names.items()
            if name in (FUNCTION, SLIDING)
        }

    def bound(
        self,
        run: Run,
        path: str,
        module: nn.Module,
        forward: Callable[..., Any],
        made: Callable[..., Any] | None,
        names: dict[str, Any],
    ) -> Callable[..., Any]:
        """``forward`` (the model's, with ``names`` from :meth:`match` bound), calling
        ``made`` (the same with :meth:`for_own_positions`' builders) where its caller
        gives no positions and the model makes its own; the report lists it where that
        or the cache removes syncs."""
        picking = _by_positions(forward, made, module)
        removed = []
        if picking is not forward:
            removed.append(
                "its masks built without reading the positions it makes itself when "
                "called without (transformers reads them for packed sequences, waiting "
                "for the GPU, where no cache is built)"
            )
        if CACHE in names:
            removed.append(
                "its KV cache's sliding-window sizes made on the device (transformers "
                "copies each from the host, waiting for the GPU)"
            )
        if removed:
            run.report.add(SYNCS, [f"{path}: {'; '.join(removed)}"])
        return picking


def _by_positions(
    forward: Callable[..., Any], made: Callable[..., Any] | None, module: nn.Module
) -> Callable[..., Any]:
    """``forward``, or ``made`` where the caller gives no positions (see
    :meth:`CausalMask.bound`); ``forward`` itself where the model does not make its own."""
    source = calling_source(module, FUNCTION) or calling_source(module, SLIDING)
    if made is None or source is None or not _MAKES_POSITIONS.search(source):
        return forward
    parameters = list(inspect.signature(forward).parameters)
    if "position_ids" not in parameters:
        return forward
    at = parameters.index("position_ids") - 1  # in the arguments after self

    @functools.wraps(forward)
    def forward_by_positions(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        given = kwargs["position_ids"] if "position_ids" in kwargs else (
            args[at] if len(args) > at else None
        )  # fmt: skip
        return (made if given is None else forward)(self, *args, **kwargs)

    return forward_by_positions


@functools.cache
def _mask_builder(
    original: Callable[..., Any],
    full: bool = True,
    documents: bool = False,
    made: bool = False,
    trusted: bool = False,
) -> Callable[..., Any]:
    """``original`` (one of transformers' mask builders), except that

    - while dynamo traces or a CUDA graph is captured, a ``full``-attention mask that
      would be plain causal is None;
    - with ``documents`` (our kernel reads them), a packed batch's full-attention mask
      is a :class:`DocumentMask`, and a sliding window that cuts a plain causal call's
      keys one of one document a row with the window (not under dynamo; an attention
      mask of ones, read once, counts as none);
    - with ``trusted``, any batch given positions is packed: its documents are made on
      the device, also under capture, for either mask (the dense mask made from them
      without ``documents``, or for heads our kernel does not take);
    - positions the model ``made`` itself are not handed on (see the module's text).

    One per original function, kind, ``documents``, ``made`` and ``trusted``."""
    from transformers.cache_utils import DynamicCache

    from ..._functional._documents import DocumentMask, grouped_heads

    if documents:  # transformers then hands our kernel grouped key heads
        grouped_heads()
    names = tuple(inspect.signature(original).parameters)
    looks = documents and full  # (in eager, our look at a full mask's positions)

    def build_mask(*args: Any, **kwargs: Any):
        # Under capture, as under a trace, no tensor's values can be read.
        compiling = torch.compiler.is_compiling()
        tracing = compiling or _capturing()
        unread = made  # the model's own positions: none packed
        windowed = documents and not full and not compiling  # (our kernel reads windows)
        if tracing or windowed or ((looks or trusted) and not made):
            given = dict(zip(names, args))
            given.update(kwargs)
            if "past_key_values" in given:  # the cache's name up to transformers 5.17 at least
                given["cache"] = given.pop("past_key_values")
            ids = _documents_on_device(given) if trusted and not compiling else None
            window = None if full else getattr(given.get("config"), "sliding_window", None)
            if ids is not None and (full or isinstance(window, int)):  # (whatever they hold)
                cut = None if full or _window_covers(given) else window  # (a window cutting keys)
                if documents and (cut is None or _our_head_dim(given)):
                    return DocumentMask(ids, functools.partial(_causal_within, ids, cut), cut)
                return _causal_within(ids, cut)
            if (
                windowed
                and isinstance(window, int)
                and not _window_covers(given)
                and _our_head_dim(given)
                and _plain_causal({**given, "attention_mask": None}, DynamicCache, made)
                and _pads_nothing(given)
            ):  # each row one document, the window for our kernel to read
                embeds = given["inputs_embeds"]
                ids = torch.zeros(embeds.shape[:2], dtype=torch.int32, device=embeds.device)
                return DocumentMask(ids, lambda: original(*args, **kwargs), window)
            if tracing:
                if _plain_causal(given, DynamicCache, made) and (full or _window_covers(given)):
                    return None
            elif looks:
                looked, packed = _packed(given)
                if packed is not None:
                    return DocumentMask(packed, lambda: original(*args, **kwargs))
                unread = looked  # none found: transformers need not look again
        if unread and "position_ids" in names:
            return original(**{**dict(zip(names, args)), **kwargs, "position_ids": None})
        return original(*args, **kwargs)

    build_mask.__wrapped__ = original  # type: ignore[attr-defined]
    build_mask.kind = (full, documents)  # type: ignore[attr-defined]
    return build_mask


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@functools.cache
def _windows_on_device(cache_class: type) -> Callable[..., Any]:
    """``cache_class`` (transformers' ``DynamicCache``), its sliding-window layers'
    window sizes made on the device of their first keys rather than copied there from
    the host (a stream sync each). One per class: the forwards binding it share a
    namespace."""

    def DynamicCache(*args: Any, **kwargs: Any) -> Any:
        cache = cache_class(*args, **kwargs)
        if torch.compiler.is_compiling():  # a trace takes transformers' own
            return cache
        for layer in getattr(cache, "layers", ()):
            window = getattr(layer, "_sliding_window_tensor", None)
            if isinstance(window, torch.Tensor) and isinstance(layer.sliding_window, int):
                layer.lazy_initialization = types.MethodType(_windows_made_there, layer)
        return cache

    return DynamicCache


def _windows_made_there(layer: Any, key_states: torch.Tensor, *rest: Any, **named: Any) -> None:
    """A sliding layer's ``lazy_initialization``, its window size made where its keys
    are (transformers' own then finds it there and copies nothing)."""
    if not (key_states.is_cuda and torch.cuda.is_current_stream_capturing()):
        layer._sliding_window_tensor = _size_on(layer.sliding_window, key_states.device)
    type(layer).lazy_initialization(layer, key_states, *rest, **named)


def _has_windows(cache_class: type, config: Any) -> bool:
    """Whether ``cache_class`` built for ``config`` holds sliding-window layers."""
    try:
        layers = cache_class(config=config).layers
    except Exception:  # a config it cannot read: left as written
        return False
    return any(hasattr(layer, "_sliding_window_tensor") for layer in layers)


@functools.lru_cache(maxsize=64)
def _size_on(value: int, device: torch.device) -> torch.Tensor:
    """A long scalar ``value`` on ``device``, made there (no copy from the host); shared,
    as transformers only reads it (never an inference tensor, whatever mode first made it)."""
    with torch.inference_mode(False):
        return torch.full((), value, dtype=torch.long, device=device)


def _only_called(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward uses the global ``name`` only to call it (a
    function in its place then serves; ``isinstance`` against it would not)."""
    source = calling_source(module, name)
    return source is not None and not re.search(rf"\b{name}\b(?!\s*\()", source)


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


def _packed(given: dict[str, Any]) -> tuple[bool, torch.Tensor | None]:
    """Whether transformers would look for packed documents in these arguments' positions
    (only without a padding mask or a cache), and the (B, T) document ids it finds there;
    None where it would find none or the mask asks for more than causal attention
    within documents."""
    positions = _batch_positions(given)
    if positions is None:
        return False, None
    from transformers.masking_utils import find_packed_sequence_indices

    return True, find_packed_sequence_indices(positions)


def _documents_on_device(given: dict[str, Any]) -> torch.Tensor | None:
    """The (B, T) document ids of these arguments' positions, each run of consecutive
    positions one document, made on the device: transformers'
    ``find_packed_sequence_indices`` without its look at the values (a host sync). None
    where the arguments are not those of causal attention within documents."""
    positions = _batch_positions(given)
    if positions is None:
        return None
    start = positions[:, :1] - 1  # (the first position starts the first document)
    return (torch.diff(positions, prepend=start, dim=-1) != 1).cumsum(-1)


def _batch_positions(given: dict[str, Any]) -> torch.Tensor | None:
    """The (B, T) positions transformers would look for packed documents in (only without
    a padding mask or a cache, for a causal mask and nothing more), or None."""
    positions = given.get("position_ids")
    if given.get("cache") is not None or not isinstance(positions, torch.Tensor):
        return None
    if not _causal_sdpa(given) or positions.dim() != 2:
        return None
    embeds = given["inputs_embeds"]
    if positions.shape[1] != embeds.shape[1]:
        return None
    return positions.expand(embeds.shape[0], -1)


def _our_head_dim(given: dict[str, Any]) -> bool:
    """Whether the config's attention heads have a head dim our kernel takes (a mask it
    would decline is built as transformers builds it, with no warning)."""
    from ..._ops.flash_attention import HEAD_DIMS

    config = given.get("config")
    heads = getattr(config, "num_attention_heads", None)
    size = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads if heads else None
    )  # fmt: skip
    return size in HEAD_DIMS


def _pads_nothing(given: dict[str, Any]) -> bool:
    """Whether ``given``'s attention mask pads nothing: none, or a (B, T) mask of ones
    over the call's tokens, as collators pass for unpadded rows. Such a mask is read on
    the host, once a forward: a wait for the GPU that transformers makes too where a
    model has full-attention layers, to leave their mask out. Any other mask (padding,
    another shape, under a trace or capture) pads."""
    mask = given.get("attention_mask")
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    embeds = given.get("inputs_embeds")
    if not isinstance(embeds, torch.Tensor) or mask.shape != embeds.shape[:2]:
        return False
    return not (torch.compiler.is_compiling() or _capturing()) and bool(mask.all())


def _window_covers(given: dict[str, Any]) -> bool:
    """Whether the config's sliding window takes in every key of these arguments (no
    cached ones: :func:`_plain_causal`), where transformers' eager sliding-window mask is
    plain causal and left out (Gemma3's default window, 4096, at T2048)."""
    window = getattr(given.get("config"), "sliding_window", None)
    return isinstance(window, int) and given["inputs_embeds"].shape[1] < window


def _plain_causal(given: dict[str, Any], dynamic: type, made: bool = False) -> bool:
    """Whether transformers would return None in eager for these arguments, decided
    without reading a tensor's values (positions the model ``made`` hold no packed
    sequences)."""
    if given.get("allow_is_causal_skip", True) is not True or not _causal_sdpa(given):
        return False
    cache = given.get("cache")
    if cache is None:
        # transformers looks for packed sequences in the positions, reading their values
        return given.get("position_ids") is None or made
    return (
        isinstance(cache, dynamic)
        and not getattr(cache, "is_compileable", False)
        and cache.get_seq_length() == 0
    )


PATTERN = CausalMask()

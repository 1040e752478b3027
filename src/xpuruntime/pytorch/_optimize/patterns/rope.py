"""The rotary embedding: an attention module whose forward calls its modeling file's
``apply_rotary_pos_emb`` (transformers' Llama and its copies), where that function
computes the half-split or interleaved rotation on probe inputs, calls the ``rope`` op
instead (:func:`ops.rope`), unless the policy names ``torch`` for it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from .._probes import rope_attention_match
from .._report import Finding
from .._run import Run

FUSED = Finding(
    "fused_ropes",
    "rotary embedding(s)",
    "{}: its rotary embedding runs as one op",
    triton=True,
    doc="the attention modules whose rotary embedding runs as ``rope``",
)


class Rope:
    findings = (FUSED,)

    def enabled(self, run: Run) -> bool:
        return run.fuses("rope")

    def match(self, run: Run, path: str, module: nn.Module) -> Callable[..., Any] | None:
        """What ``module``'s forward is to call as ``apply_rotary_pos_emb``, or None (and
        the report says why where the probe refutes the original)."""
        if not self.enabled(run):
            return None
        match = rope_attention_match(module, _rope_in_place_of)
        if match is None:
            return None
        rope, why = match
        if rope is None:
            run.skip(path, f"{type(module).__name__}: {why}")
        return rope


@functools.cache
def _rope_in_place_of(original: Callable[..., Any], interleaved: bool) -> Callable[..., Any]:
    """What an optimized attention calls in place of its modeling file's
    ``apply_rotary_pos_emb`` (``original``): the policy's ``rope`` op on the calls it
    takes (q and k as (batch, heads, tokens, head_dim), ``unsqueeze_dim=1``, angles
    without gradients), ``original`` on any other. One per original function, which
    every layer of a model (and every model of that modeling file) shares."""
    from ..._functional._rope import rope, takes_call

    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, **kwargs: Any):
        if not takes_call(q, k, cos, sin, args, kwargs):
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin, interleaved)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb.interleaved = interleaved  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


PATTERN = Rope()

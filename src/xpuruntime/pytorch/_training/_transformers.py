"""What a graphed step prepares for a Hugging Face transformers model before capture.

A transformers decoder builds its attention masks in every forward. Where its layers
differ in kind (``config.layer_types``: sliding and full attention, as Gemma 2/3,
Qwen 2/3, Mistral's successors), the masks depend only on the batch's shape when no
padding mask is given, and the model takes them ready made (the mapping that
``transformers.masking_utils.create_masks_for_generate`` builds for ``generate``). The
step builds them once, on the device, and calls the model with them and with
``use_cache=False``: a training forward otherwise builds a KV cache each time, whose
sliding-window layers copy a host tensor to the device (which a capture cannot hold),
and without a cache the model looks for packed sequences by reading a value back to
the host. Models whose layers are all alike (Llama) keep their own path, which a graph
already holds (mask None, SDPA's causal flag).

A model's forward may shape its masks further (an overlay of its own): the prepared
forward is used only where its loss equals the model's own on the sample batch (same
random state), checked once before the warm-up.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

_log = logging.getLogger("xpuruntime.pytorch.graphs")
_PREPARED_KEYS = frozenset({"input_ids", "labels"})  # what a mapping batch may hold


class PreparedForward:
    """``model(input_ids, attention_mask=masks, use_cache=False)`` (or
    ``model(**batch, ...)`` for a mapping batch): the masks built once for the batch's
    shape (static tensors a graph reads on every replay)."""

    def __init__(self, model: torch.nn.Module, masks: dict[str, Any]) -> None:
        self.model = model
        self.masks = masks

    def __call__(self, *inputs: torch.Tensor, **named: torch.Tensor) -> Any:
        return self.model(*inputs, **named, attention_mask=self.masks, use_cache=False)

    def agrees(self, loss_of: Callable[[Callable[..., Any]], torch.Tensor]) -> bool:
        """Whether ``loss_of(self)`` equals ``loss_of(model)`` (no gradient, the same
        random state for both)."""
        device = next(self.model.parameters()).device
        cuda = [device] if device.type == "cuda" else []
        losses = []
        for forward in (self.model, self):
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                torch.manual_seed(0)
                losses.append(loss_of(forward).detach().float())
        return bool(torch.allclose(losses[0], losses[1], rtol=1e-4, atol=1e-6))

    def describe(self) -> str:
        built = ", ".join(
            f"{kind}: {'causal flag' if mask is None else tuple(mask.shape)}"
            for kind, mask in sorted(self.masks.items())
        )
        return f"attention masks built before capture ({built}), KV cache off"


def prepared_forward(model: torch.nn.Module, inputs: Any) -> PreparedForward | None:
    """The forward a graphed step should capture for ``model`` called on ``inputs`` (the
    input ids, or a mapping of ``input_ids`` and ``labels``), or None where the model is
    called as it is (not a transformers model, layers all alike, a padding mask or other
    arguments given)."""
    module = getattr(model, "module", model)  # DistributedDataParallel's
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    if "peft" in sys.modules:  # a peft model passes the masks on to the model it wraps
        from peft import PeftModel

        if isinstance(module, PeftModel):
            module = module.get_base_model()
    if not isinstance(module, PreTrainedModel):
        return None
    if isinstance(inputs, Mapping):
        if not set(inputs) <= _PREPARED_KEYS:
            return None  # a padding mask, positions, embeddings: as the user calls
        input_ids = inputs.get("input_ids")
    else:
        input_ids = inputs[0] if isinstance(inputs, tuple) and len(inputs) == 1 else inputs
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None  # inputs_embeds, a padding mask, keyword inputs: as the user calls
    if input_ids.is_floating_point() or input_ids.is_complex():
        return None
    config = module.config.get_text_config()
    if not getattr(config, "layer_types", None):
        return None
    if getattr(config, "use_bidirectional_attention", False):
        return None  # the model overlays its own mask function
    from transformers.masking_utils import create_masks_for_generate

    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    shape = (*input_ids.shape, 1)  # the masks read the batch, length, dtype and device
    embeds = torch.empty(shape, dtype=dtype or torch.float32, device=input_ids.device)
    masks = create_masks_for_generate(module.config, embeds, None, None)
    if not isinstance(masks, dict):
        return None
    prepared = PreparedForward(model, masks)
    _log.info("%s: %s", type(module).__name__, prepared.describe())
    return prepared

"""No KV cache in a training forward. A transformers model whose config leaves
``use_cache`` on builds one in every forward, training ones included: a copy of every
layer's keys and values, and host time per layer. With a cache, transformers also no
longer looks for packed sequences in ``position_ids``, so a padding-free batch's
documents would attend to each other. A forward in training mode with gradients on is
called with ``use_cache=False``, unless the call passes ``use_cache`` or a cache itself.
transformers applies that rule under gradient checkpointing, and Unsloth in training."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .._report import Finding
from .._run import Run

CACHES = Finding(
    "kv_caches_in_training",
    "KV cache(s) in training forwards",
    "{}: config.use_cache is on, but a forward in training mode with gradients builds no "
    "KV cache (a call passing use_cache=True or a cache still gets one)",
    verb="turned off",
    listed_when_empty=False,
    doc="models whose training forwards build no KV cache though ``config.use_cache`` is on",
)
_CACHES = ("cache", "past_key_values")  # transformers 5.24's name, and the one before


def no_training_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The forward pre-hook: ``use_cache=False`` for a training call that names neither
    ``use_cache`` nor a cache (nor passes more than its first argument by position)."""
    if not (module.training and torch.is_grad_enabled()) or len(args) > 1:
        return None
    if kwargs.get("use_cache") is not None or any(kwargs.get(k) is not None for k in _CACHES):
        return None
    return args, {**kwargs, "use_cache": False}


class TrainingCache:
    findings = (CACHES,)

    def enabled(self, run: Run) -> bool:
        return True

    def apply_model(self, run: Run) -> None:
        model = run.model
        config = getattr(model, "config", None)  # a peft model reads its base's
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not (getattr(text, "use_cache", False) and hasattr(model, "generate")):
            return
        parameters = inspect.signature(model.forward).parameters.values()
        if not any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in parameters):
            return
        if no_training_cache not in model._forward_pre_hooks.values():  # (a loaded model's)
            handle = model.register_forward_pre_hook(no_training_cache, with_kwargs=True)
            run.report.on_revert(handle.remove)
        run.report.add(CACHES, ["<model>"])


PATTERN = TrainingCache()

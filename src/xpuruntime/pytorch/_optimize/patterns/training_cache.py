"""A finding, not a rewrite: a transformers model whose config leaves ``use_cache`` on
builds a KV cache in every forward, training ones included (a copy of every layer's
keys and values, host time per layer; the waits its sliding layers' host copies made
are gone: :mod:`.causal_mask`). The report says so and how to turn it off; the model is
left as it is, since the cache is part of what its forward returns."""

from __future__ import annotations

from .._report import Finding
from .._run import Run

CACHES = Finding(
    "kv_caches_in_training",
    "KV cache(s) built in training",
    "{}: config.use_cache is on, so transformers builds a KV cache in every forward, "
    "training ones included (a copy of each layer's keys and values, and host time); to "
    "train, set model.config.use_cache = False",
    verb="found",
    listed_when_empty=False,
    doc="models whose config leaves ``use_cache`` on in training (a finding; nothing is changed)",
)


class TrainingCache:
    findings = (CACHES,)

    def enabled(self, run: Run) -> bool:
        return True

    def apply_model(self, run: Run) -> None:
        config = getattr(run.model, "config", None)  # a peft model reads its base's
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "use_cache", False) and hasattr(run.model, "generate"):
            run.report.add(CACHES, ["<model>"])


PATTERN = TrainingCache()

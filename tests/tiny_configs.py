"""Tiny transformers configs for the tests of models we did not write (random weights,
nothing downloaded): the fields shared by every family, and what transformers' versions
name differently."""

import inspect

SMALL = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def cache_argument(builder) -> str:
    """The name transformers' mask ``builder`` takes its cache by: ``cache`` (5.24), or
    ``past_key_values`` (up to 5.17 at least, the GPU image's)."""
    return "cache" if "cache" in inspect.signature(builder).parameters else "past_key_values"


def output_cache(output):
    """A model output's KV cache: ``output.cache`` (5.24), or ``output.past_key_values``
    (5.17, the GPU image's)."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache

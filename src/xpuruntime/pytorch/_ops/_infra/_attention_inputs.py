"""The checks on attention arguments every attention kernel's caller runs (no Triton
needed: PyTorch's own backends use them too)."""

import torch

from ...._errors import InvalidInputError

__all__ = ["check_attention"]


def check_attention(query, key, value, attn_mask, dropout_p) -> None:
    """Raise :class:`~xpuruntime.InvalidInputError` naming what is wrong with attention
    arguments (ranks, dtypes, devices, shapes, the mask's type, ``dropout_p``); the
    checks every attention kernel's caller runs before PyTorch's or ours see them."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = t.shape if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInputError(
                f"fused_attention: {name} must be a 4-D tensor (batch, heads, seq, head_dim), "
                f"got {got}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise InvalidInputError(
            f"fused_attention: query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise InvalidInputError(
            f"fused_attention: query, key and value must be on one device, got "
            f"{query.device}, {key.device}, {value.device}"
        )
    b, h, _, d = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != b or key.shape[3] != d:
        raise InvalidInputError(
            f"fused_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"(batch={b}, kv_heads, seq_k, head_dim={d}) with the same kv_heads and seq_k"
        )
    if h % key.shape[1]:
        raise InvalidInputError(
            f"fused_attention: query heads ({h}) must be a multiple of key/value heads "
            f"({key.shape[1]})"
        )
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise InvalidInputError(
            f"fused_attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}"
        )
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise InvalidInputError(f"fused_attention: dropout_p must be in [0, 1), got {dropout_p!r}")

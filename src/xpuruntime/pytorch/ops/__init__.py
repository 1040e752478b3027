"""Ops whose kernel the policy chooses per call (one op per module)."""

from .fused_attention import fused_attention

__all__ = ["fused_attention"]

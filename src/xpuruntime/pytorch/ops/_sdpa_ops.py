"""PyTorch's SDPA backend ops, called directly once our policy has chosen the backend.

``F.scaled_dot_product_attention`` validates its inputs, asks PyTorch's selector for a
backend under the SDPA flags, and calls that backend's op. Once the policy has chosen the
backend for a call signature, calling that op ourselves runs the same op with the same
arguments, without the selection and without switching the flags around the call.

Only calls that F.sdpa hands to the op unchanged qualify: no mask (F.sdpa converts and
pads masks), no grouped-query attention, and, for FlashAttention on CUDA, a head_dim
that is a multiple of 8 (F.sdpa pads it otherwise). The ops are private to PyTorch, so
each is used only where its schema is the one written here; otherwise F.sdpa runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["backend_op"]

# (kernel, device type) -> (aten op, its arguments as this module calls them).
_SCHEMAS = {
    ("flash_v2", "cuda"): (
        "_scaled_dot_product_flash_attention",
        "(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, "
        "bool return_debug_mask=False, *, float? scale=None)",
    ),
    ("flash_v2", "cpu"): (
        "_scaled_dot_product_flash_attention_for_cpu",
        "(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, "
        "*, Tensor? attn_mask=None, float? scale=None)",
    ),
    ("efficient", "cuda"): (
        "_scaled_dot_product_efficient_attention",
        "(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, "
        "float dropout_p=0., bool is_causal=False, *, float? scale=None)",
    ),
    ("cudnn", "cuda"): (
        "_scaled_dot_product_cudnn_attention",
        "(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, "
        "float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, "
        "float? scale=None)",
    ),
}
_ops: dict[tuple[str, str], Any] | None = None


def backend_op(kernel: str, query: torch.Tensor, needs_lse: bool) -> Callable[..., Any] | None:
    """The op to call as ``op(q, k, v, dropout_p, is_causal[, scale=s])[0]`` for a call
    without mask or GQA that ``kernel`` runs, or None where F.sdpa must run it.

    ``needs_lse`` says whether autograd will need the log-sum-exp (an input requires
    grad with grad mode on), which F.sdpa passes to the efficient and cuDNN ops.
    """
    device = query.device.type
    if device == "cuda" and kernel == "flash_v2" and query.shape[-1] % 8:
        return None
    op = _verified_ops().get((kernel, device))
    if op is None or kernel == "flash_v2":
        return op
    lse = bool(needs_lse)

    def call(q, k, v, dropout_p, is_causal, scale=None):
        return op(q, k, v, None, lse, dropout_p, is_causal, scale=scale)

    return call


def _verified_ops() -> dict[tuple[str, str], Any]:
    global _ops
    if _ops is None:
        found = {}
        if hasattr(torch._C, "_is_any_autocast_enabled"):  # the call path's autocast check
            for key, (name, arguments) in _SCHEMAS.items():
                overload = getattr(getattr(torch.ops.aten, name, None), "default", None)
                if overload is not None and str(overload._schema).startswith(
                    f"aten::{name}{arguments} -> (Tensor"
                ):
                    found[key] = getattr(torch, name)
        _ops = found
    return _ops

"""``attention="flash_v4"``: FlashAttention-4 (Tri Dao's group; the
``flash-attn-4`` package, written in the CuTe DSL) in PyTorch's FLASH backend.

PyTorch's own hook puts it there: its FA4 registration
(``torch.nn.attention._fa4.register_flash_attention_fa4``) puts FA4's kernels behind the
FLASH backend's aten ops, activated with ``torch.nn.attention.activate_flash_attention_impl``.
We register that function under our own name (:data:`IMPL`), pointed at
:mod:`._fa4_interface`, because torch 2.11's hook and the released flash-attn-4 disagree
on the forward's results. This kernel is that backend with FA4 active (and ``flash_v2``
the backend with PyTorch's FlashAttention-2 restored: each kernel's runner makes the
backend run its own implementation before it calls it).
A policy naming ``flash_v4`` activates FA4 when it is set, so the model's own
``F.scaled_dot_product_attention`` calls run it too, and clearing the policy restores
FlashAttention-2. Install with ``pip install 'xpuruntime[flash4]'`` (CUDA builds of
torch >= 2.11; Hopper or Blackwell GPUs).

Its kernels launch from Python (the CuTe DSL converts the arguments on every call): about
0.2 ms of host time per forward on an H200 host, 3-7x FlashAttention-2's. It is faster
where the GPU time per call exceeds that (long sequences; BENCHMARKS.md), so it follows
``flash_v2`` and ``cudnn`` in ``first_supported``'s order and ``best_performance``
measures it.
"""

from __future__ import annotations

import importlib.util

import torch

from ...kernels import Support
from ._context import AttentionContext
from .attention import SdpaBackend

__all__ = ["IMPL", "FlashV4"]

IMPL = "FA4 (xpuruntime)"
"""The name FA4 is activated under in PyTorch's flash-attention registry."""

try:
    from torch.nn.attention import _fa4 as _torch_fa4
    from torch.nn.attention import register_flash_attention_impl
except ImportError:  # torch < 2.11: no FA4 hook
    _torch_fa4 = None
else:
    register_flash_attention_impl(
        IMPL,
        register_fn=lambda: _torch_fa4.register_flash_attention_fa4(
            module_path=f"{__package__}._fa4_interface"
        ),
    )


class FlashV4(SdpaBackend):
    name = "flash_v4"
    impl = IMPL
    probe = "can_use_flash_attention"
    summary = "FlashAttention-4 (flash-attn-4, CuTe DSL) as PyTorch's FLASH backend"

    def _missing_library(self) -> str | None:
        if _torch_fa4 is None:
            return f"torch {torch.__version__} has no FA4 hook (torch >= 2.11 does)"
        try:
            found = importlib.util.find_spec("flash_attn.cute") is not None
        except ImportError:
            found = False
        if not found:
            return "flash-attn-4 is not installed (pip install 'xpuruntime[flash4]')"
        return None

    def unavailable(self, device: torch.device) -> str | None:
        """Why FA4 cannot run on ``device`` at all (None when it can)."""
        if device.type != "cuda":
            return f"FA4 runs on CUDA devices (Hopper, Blackwell); this is {device}"
        missing = self._missing_library()
        if missing:
            return missing
        major, minor = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return (
                f"FA4 runs on compute capability 9.x (Hopper) and 10.x (Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
            )
        return None

    def _supports_cuda(self, ctx: AttentionContext) -> Support:
        why = self.unavailable(ctx.device)
        if why is not None:
            return Support(False, why, missing_backend="not installed" in why)
        major = torch.cuda.get_device_capability(ctx.device)[0]
        if ctx.dtype not in (torch.float16, torch.bfloat16):
            return Support.no(f"FA4 takes fp16 and bf16, not {ctx.dtype}")
        if ctx.dropout_p:
            return Support.no("FA4 has no dropout")
        head_dim, head_dim_v = ctx.query.shape[-1], ctx.value.shape[-1]
        largest = 256 if major == 9 else 128
        if not (8 <= head_dim <= largest and head_dim % 8 == 0 and head_dim_v == head_dim):
            return Support.no(
                f"FA4 on compute capability {major}.x takes head dims that are multiples "
                f"of 8 from 8 to {largest}, the same for query and value; got {head_dim}"
            )
        return super()._supports_cuda(ctx)

    def _supports_host(self, ctx: AttentionContext) -> Support:
        return Support.no(f"FA4 runs on CUDA devices (Hopper, Blackwell); this is {ctx.device}")

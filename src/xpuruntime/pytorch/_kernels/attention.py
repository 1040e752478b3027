"""The ``attention`` kernels: PyTorch's SDPA backends, each run alone through
``F.scaled_dot_product_attention`` with only its flag on, and our Triton kernel
(:mod:`.._ops.flash_attention`).

Each answers ``supports`` with PyTorch's own probes where they exist
(``torch.backends.cuda.can_use_flash_attention(..., debug=True)`` and its siblings
explain a rejection in PyTorch's words). An SDPA backend's runner is also its
:meth:`~TorchKernel.direct` runner: PyTorch's selector refuses what the backend cannot
run with those same checks.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ...kernels import Support
from .._ops._infra._attention_inputs import check_attention
from ._base import TorchKernel, cudnn_missing, triton_refusal
from ._context import AttentionContext
from ._switches import (
    EXCLUSIVE_SDPA,
    SDPA_BACKENDS,
    flash_impl,
    only_sdpa_backend,
    read_sdpa_flags,
    use_flash_impl,
    write_sdpa_flags,
)

__all__ = [
    "NONDETERMINISTIC_SDPA",
    "Cudnn",
    "Efficient",
    "FlashV2",
    "Math",
    "SdpaBackend",
    "TritonAttention",
    "sdpa",
]

_deterministic = torch._C._get_deterministic_algorithms  # what torch.are_... returns


class SdpaBackend(TorchKernel):
    """One of PyTorch's SDPA backends, run alone."""

    op = "attention"
    probe: ClassVar[str | None] = None
    nondeterministic_backward: ClassVar[bool] = False
    impl: ClassVar[str | None] = None
    """For the FLASH backend's kernels: the implementation PyTorch's FLASH backend must
    run (None: its own FlashAttention-2; see ``torch.nn.attention``'s flash impls)."""

    @property
    def backend(self) -> Any:
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, SDPA_BACKENDS[self.name])

    def supports(self, ctx: AttentionContext) -> Support:
        if ctx.deterministic and ctx.requires_grad and self.nondeterministic_backward:
            return Support.no(
                f"{self.name}'s backward is not deterministic and the policy asks for "
                "deterministic kernels"
            )
        if ctx.device.type == "cuda":
            return self._supports_cuda(ctx)
        return self._supports_host(ctx)

    def _supports_cuda(self, ctx: AttentionContext) -> Support:
        missing = self._missing_library()
        if missing:
            return Support.unavailable(missing)
        probe = getattr(torch.backends.cuda, self.probe or "", None)
        if probe is None:
            return self._ask_pytorch(ctx, "")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = probe(_sdpa_params(ctx), True)
        if ok:
            return Support.yes(f"PyTorch's {self.probe} accepts these inputs")
        reasons = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
        return Support.no(f"PyTorch's {self.probe} refuses: {reasons}")

    def _supports_host(self, ctx: AttentionContext) -> Support:
        return Support.no(f"{self.name} runs on CUDA devices; this is {ctx.device}")

    def _missing_library(self) -> str | None:
        return None

    def _ask_pytorch(self, ctx: AttentionContext, what: str) -> Support:
        """Ask PyTorch's own selector whether this backend alone would run the call."""
        with only_sdpa_backend(self.name):
            choice = torch._fused_sdp_choice(
                ctx.query,
                ctx.key,
                ctx.value,
                ctx.attn_mask,
                ctx.dropout_p,
                ctx.is_causal,
                **({"enable_gqa": True} if ctx.enable_gqa else {}),
            )
        if choice == int(self.backend):
            return Support.yes(f"PyTorch selects {self.name} for these inputs{what}")
        return Support.no(f"PyTorch's selector does not take {self.name} for these inputs{what}")

    def runner(self) -> Any:
        wanted = EXCLUSIVE_SDPA[self.name]
        impl = self.impl
        flash = SDPA_BACKENDS[self.name] == "FLASH_ATTENTION"

        def run(query, key, value, attn_mask, dropout_p, is_causal, scale):
            if flash and flash_impl() != impl:
                use_flash_impl(impl)
            try:
                return exclusive_sdpa(
                    wanted, query, key, value, attn_mask, dropout_p, is_causal, scale
                )
            except RuntimeError:
                check_attention(query, key, value, attn_mask, dropout_p)  # our error first
                raise

        return run

    def direct(self) -> Any:
        run = self.runner()
        if not self.nondeterministic_backward:
            return run

        def direct(*args):
            if _deterministic():  # the dispatcher decides (falls back, or refuses)
                raise RuntimeError(f"{self.name}'s backward is not deterministic")
            return run(*args)

        return direct


class FlashV2(SdpaBackend):
    name = "flash_v2"
    probe = "can_use_flash_attention"
    summary = "PyTorch's FLASH_ATTENTION backend (FlashAttention-2; its C++ port on the CPU)"

    def _missing_library(self) -> str | None:
        available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if not available():
            return f"this torch build ({torch.__version__}) was compiled without FlashAttention"
        return None

    def _supports_host(self, ctx: AttentionContext) -> Support:
        if ctx.device.type != "cpu":
            return Support.no(f"flash_v2 runs on CUDA devices and the CPU, not {ctx.device}")
        if ctx.dropout_p > 0:
            return Support.no("PyTorch's CPU flash kernel has no dropout")
        return self._ask_pytorch(ctx, " (CPU flash kernel)")


class Cudnn(SdpaBackend):
    name = "cudnn"
    probe = "can_use_cudnn_attention"
    nondeterministic_backward = True
    summary = "PyTorch's CUDNN_ATTENTION backend (cuDNN fused flash attention)"

    def _missing_library(self) -> str | None:
        missing = cudnn_missing()
        if missing is None and (torch.backends.cudnn.version() or 0) < 90000:
            return f"cuDNN attention needs cuDNN >= 9, found {torch.backends.cudnn.version()}"
        return missing


class Efficient(SdpaBackend):
    name = "efficient"
    probe = "can_use_efficient_attention"
    summary = "PyTorch's EFFICIENT_ATTENTION backend (xFormers memory-efficient kernels)"


class Math(SdpaBackend):
    name = "math"
    summary = "PyTorch's MATH backend (bmm + softmax + bmm, in the input precision)"

    def supports(self, ctx: AttentionContext) -> Support:
        return Support.yes("the math backend runs any inputs")


# PyTorch's SDPA backends whose backward is not deterministic.
NONDETERMINISTIC_SDPA = frozenset(
    cls.name for cls in (FlashV2, Cudnn, Efficient, Math) if cls.nondeterministic_backward
)


class TritonAttention(TorchKernel):
    op = "attention"
    name = "triton"
    summary = "xpuruntime's FlashAttention-2-style Triton kernel (forward and backward)"

    def supports(self, ctx: AttentionContext) -> Support:
        refused = triton_refusal(ctx.device)
        if refused is not None:
            return refused
        from .._ops.flash_attention import unsupported

        why = unsupported(ctx.query, ctx.key, ctx.value, ctx.attn_mask, ctx.dropout_p)
        if why is not None:
            return Support.no(why)
        return Support.yes("our Triton kernel takes these inputs (deterministic backward)")

    def runner(self) -> Any:
        from .._ops.flash_attention import attention

        def run(query, key, value, attn_mask, dropout_p, is_causal, scale):
            # Checked on every call: the call signature leaves out key and value's dtype
            # and device, which PyTorch's backends check for themselves.
            check_attention(query, key, value, attn_mask, dropout_p)
            return attention(query, key, value, is_causal, scale)

        return run


def exclusive_sdpa(
    wanted, query, key, value, attn_mask, dropout_p, is_causal, scale
) -> torch.Tensor:
    """F.sdpa with PyTorch's SDPA flags set to ``wanted`` (one backend alone) around the
    call; only the flags that differ are written (this runs on every attention call)."""
    saved = read_sdpa_flags()
    if saved == wanted:
        saved = None
    else:
        write_sdpa_flags(saved, wanted)
    try:
        # Only the arguments that differ from F.sdpa's defaults, in the form its callers
        # use: PyTorch's argument parser costs ~0.1 µs per argument, more for a keyword.
        # (Calling the backend's aten op directly skips PyTorch's selection but cost ~3 µs
        # more on an H100 host: the op hands Python nine outputs where F.sdpa hands one.)
        if scale is not None or key.shape[1] != query.shape[1]:
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if attn_mask is None and not dropout_p:
            if is_causal:
                return F.scaled_dot_product_attention(query, key, value, is_causal=True)
            return F.scaled_dot_product_attention(query, key, value)
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal)
    finally:
        if saved is not None:
            write_sdpa_flags(wanted, saved)


def sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor:
    """F.sdpa on the op's arguments, grouped-query attention where key and value have
    fewer heads than query."""
    if key.shape[1] != query.shape[1]:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale
    )


def _sdpa_params(ctx: AttentionContext) -> Any:
    args = (ctx.query, ctx.key, ctx.value, ctx.attn_mask, ctx.dropout_p, ctx.is_causal)
    try:
        return torch.backends.cuda.SDPAParams(*args, ctx.enable_gqa)
    except TypeError:  # torch < 2.5 has no enable_gqa
        return torch.backends.cuda.SDPAParams(*args)

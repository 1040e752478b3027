"""Resolution of the process-wide ops (matmul, conv) through the dispatcher, and the
keys under which kernel timings are kept across runs (``best_performance``)."""

from __future__ import annotations

import json
import math
import platform
import warnings
from dataclasses import replace
from typing import Any

import torch

from ..._errors import BackendUnavailableError, UnsupportedOperationError
from ..._files import default_cache_dir
from ...kernels import Decision, FallbackWarning, MeasurementCache, dispatcher, registry
from ...policies import KernelPolicy
from .._kernels import auto_order
from .._kernels._base import cudnn_missing
from .._kernels._context import DeviceContext
from .._kernels._switches import SDPA_BACKENDS, Switches
from ._timing import time_call

__all__ = [
    "as_frozen",
    "flash_impl_for",
    "measurement_key",
    "measurements",
    "requested_kernel",
    "resolve_process_wide",
    "sdpa_backend_refusal",
    "sdpa_backend_unavailable",
]


def _target_device() -> torch.device:
    # torch.cuda.is_available() does not create a CUDA context (an allocator choice made
    # later must still be possible), and the index does not change what is supported.
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_process_wide(policy: KernelPolicy, base: Switches) -> dict[str, Decision]:
    """The process-wide ops' decisions (matmul, conv) for ``policy``; ``base``: the
    switches before any policy, whose BLAS library ``matmul=default`` means."""
    ctx = DeviceContext(_target_device(), policy.deterministic)
    measured = policy.auto_strategy == "best_performance" and ctx.device.type == "cuda"
    requested, frozen = requested_kernel(policy, "matmul", {})
    matmul = dispatcher.select(
        "matmul",
        ctx,
        requested=requested,
        strategy="best_performance" if measured else "first_supported",
        strict=policy.strict,
        order=auto_order("matmul"),
        measure=lambda kernel: _time_matmul(kernel.name, ctx.device, base.blas or "cublas"),
        cache=measurements() if measured else None,
        cache_key=measurement_key("matmul", ctx.device, {"shapes": _MATMUL_SHAPES}),
    )
    conv_requested, conv_frozen = requested_kernel(policy, "conv", {})
    # cudnn_benchmark is itself the measured choice, so conv's auto never measures.
    conv = dispatcher.select(
        "conv", ctx, requested=conv_requested, strict=policy.strict, order=auto_order("conv")
    )
    decisions = {"matmul": as_frozen(matmul, frozen), "conv": as_frozen(conv, conv_frozen)}
    if policy.deterministic and policy.get("attention") == "cudnn":
        reason = "cuDNN attention's backward is not deterministic"
        if policy.strict:
            raise UnsupportedOperationError(
                f"attention: the policy asks for 'cudnn' and for deterministic kernels: "
                f"{reason} (strict mode, so no fallback)",
                (("cudnn", reason),),
            )
        warnings.warn(
            f"attention: {reason}; deterministic=True leaves the cuDNN backend off",
            FallbackWarning,
            stacklevel=3,
        )
    return decisions


# Representative GEMMs for the process-wide matmul choice, in bf16: small and large
# squares, and a tall-skinny transformer projection (tokens x hidden -> 4 x hidden).
_MATMUL_SHAPES = [(1024, 1024, 1024), (4096, 4096, 4096), (16384, 768, 3072)]


def _time_matmul(name: str, device: torch.device, default: str) -> float:
    """The geometric mean of the seconds per GEMM over :data:`_MATMUL_SHAPES`: every
    shape weighs alike in the comparison (a sum would let the largest GEMM decide; on an
    H200 the libraries tie within 1% on large GEMMs, and cuBLAS's lower per-call cost
    shows on small ones)."""
    library = {"cublas": "cublas", "cublasLt": "cublaslt"}.get(name, default)
    previous = torch.backends.cuda.preferred_blas_library()
    pairs = [
        (torch.randn(m, k, device=device, dtype=torch.bfloat16),
         torch.randn(k, n, device=device, dtype=torch.bfloat16))
        for m, k, n in _MATMUL_SHAPES
    ]  # fmt: skip
    try:
        torch.backends.cuda.preferred_blas_library(library)
        seconds = [time_call(lambda a=a, b=b: a @ b, device) for a, b in pairs]
        return math.prod(seconds) ** (1 / len(seconds))
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def requested_kernel(
    policy: KernelPolicy, op: str, shape_class: dict[str, Any]
) -> tuple[str | None, dict[str, Any] | None]:
    """What to ask the dispatcher for ``op`` on calls of ``shape_class``: the kernel the
    policy names, else the one it froze for the shape class (then also that frozen
    decision), else None (auto)."""
    named = policy.get(op)
    if named not in (None, "auto"):
        return named, None
    frozen = policy.frozen_for(op, shape_class)
    return (None, None) if frozen is None else (frozen["kernel"], frozen)


def as_frozen(decision: Decision, frozen: dict[str, Any] | None) -> Decision:
    """``decision``, made for a frozen decision's kernel as if the policy named it,
    said as the frozen decision it is (with the reason it was first chosen for). A
    frozen kernel that could not run stays the fallback the dispatcher made of it."""
    if frozen is None or decision.source != "policy":
        return decision
    first = f" (first chosen: {frozen['reason']})" if frozen["reason"] else ""
    support = decision.reason.removeprefix("the policy asks for it; ")
    return replace(
        decision,
        source="frozen",
        requested=None,
        reason=f"frozen in the policy for this shape class{first}; {support}",
    )


def measurements() -> MeasurementCache:
    """The on-disk cache of kernel timings (``best_performance``)."""
    return MeasurementCache(default_cache_dir() / "kernel-selection")


def measurement_key(
    op: str, device: torch.device, shape_class: dict[str, Any], replayed: bool = False
) -> str:
    """What a timing depends on: the op, the device, the library versions, the shape
    class, and whether it timed CUDA-graph replays rather than eager calls."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    return json.dumps(
        {
            "op": op,
            "device": name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available()
            else None,
            "shape_class": shape_class,
            **({"timed": "graph replays"} if replayed else {}),
        },
        sort_keys=True,
    )


def sdpa_backend_unavailable(attention: str | None) -> str | None:
    """Why PyTorch's SDPA backend named ``attention`` cannot run in this process (None:
    it can, or ``attention`` names none of them; FlashAttention-4 is
    :func:`flash_impl_for`'s)."""
    # The FLASH backend has a CPU kernel of its own; FlashAttention-4 is flash_impl_for's.
    if attention not in SDPA_BACKENDS or attention in ("math", "flash_v2", "flash_v4"):
        return None
    backend = SDPA_BACKENDS[attention]
    if _target_device().type != "cuda":
        return f"PyTorch's {backend} SDPA backend runs on CUDA devices; this machine has none"
    if attention == "cudnn":
        return cudnn_missing()
    return None


def sdpa_backend_refusal(policy: KernelPolicy) -> str | None:
    """:func:`sdpa_backend_unavailable` for the policy's ``attention``: an error under
    ``strict`` (its switches would leave every SDPA call without a backend, in any model
    of the process), else a FallbackWarning (the switches are then left as they are).

    Raises
    ------
    UnsupportedOperationError
        ``strict`` and the backend cannot run here (nothing is changed then).
    """
    attention = policy.get("attention")
    why = sdpa_backend_unavailable(attention)
    if why is None:
        return None
    if policy.strict:
        raise UnsupportedOperationError(
            f"attention: the policy asks for {attention!r}: {why} (strict mode: with only "
            "that backend enabled, every scaled_dot_product_attention call in the process "
            "would fail)",
            ((attention, why),),
        )
    warnings.warn(
        f"attention: {attention}: {why}; PyTorch's SDPA switches are left as they are",
        FallbackWarning,
        stacklevel=4,
    )
    return why


def flash_impl_for(policy: KernelPolicy) -> str | None:
    """FA4's name in PyTorch's registry (:data:`._kernels.flash_v4.IMPL`) when
    ``policy`` names ``attention="flash_v4"`` and FlashAttention-4 can run on this
    machine's GPU (so that the policy activates it in PyTorch's FLASH backend);
    otherwise None, after a FallbackWarning for a policy naming it.

    Raises
    ------
    BackendUnavailableError, UnsupportedOperationError
        ``strict`` and FlashAttention-4 cannot run here (nothing is changed then).
    """
    if policy.get("attention") != "flash_v4":
        return None
    kernel = registry.get("attention", "flash_v4")
    why = kernel.unavailable(_target_device())
    if why is None:
        return kernel.impl
    if policy.strict:
        error = BackendUnavailableError if "not installed" in why else UnsupportedOperationError
        raise error(
            f"attention: the policy asks for 'flash_v4': {why} (strict mode, so no fallback)"
        )
    warnings.warn(
        f"attention: flash_v4: {why}; PyTorch's FLASH backend keeps FlashAttention-2 and "
        "each fused_attention call falls back as the dispatcher decides",
        FallbackWarning,
        stacklevel=4,
    )
    return None

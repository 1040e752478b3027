"""PyTorch's process-wide switches that a kernel policy sets, and how to restore them.

Everything a policy changes goes through :class:`Switches`, so that clearing a policy
(or leaving a ``kernel_policy`` block) puts back exactly what was there before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "SDPA_BACKENDS",
    "Switches",
    "EXCLUSIVE_SDPA",
    "flash_impl",
    "only_sdpa_backend",
    "plan",
    "read_sdpa_flags",
    "write_sdpa_flags",
    "sdpa_priority",
    "use_flash_impl",
]

# Our attention kernel names -> PyTorch's SDPBackend member names.
SDPA_BACKENDS = {
    "flash_v2": "FLASH_ATTENTION",
    "flash_v4": "FLASH_ATTENTION",  # with FA4 active in that backend
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "cudnn": "CUDNN_ATTENTION",
}
_SETTERS = {
    "flash_v2": (torch._C._get_flash_sdp_enabled, torch._C._set_sdp_use_flash),
    "efficient": (torch._C._get_mem_efficient_sdp_enabled, torch._C._set_sdp_use_mem_efficient),
    "math": (torch._C._get_math_sdp_enabled, torch._C._set_sdp_use_math),
    "cudnn": (torch._C._get_cudnn_sdp_enabled, torch._C._set_sdp_use_cudnn),
}
_HAS_PRIORITY = hasattr(torch._C, "_get_sdp_priority_order")


@dataclass(frozen=True)
class Switches:
    """A snapshot of the switches a policy touches."""

    blas: str | None
    sdpa: tuple[tuple[str, bool], ...]
    sdpa_priority: tuple[int, ...] | None
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    tf32_matmul: bool
    tf32_cudnn: bool
    cublas_workspace_config: str | None
    flash_impl: str | None = None

    @classmethod
    def capture(cls) -> Switches:
        return cls(
            blas=_blas_library(),
            sdpa=tuple((name, get()) for name, (get, _) in _SETTERS.items()),
            sdpa_priority=tuple(torch._C._get_sdp_priority_order()) if _HAS_PRIORITY else None,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            flash_impl=flash_impl(),
        )

    def apply(self) -> None:
        """Set PyTorch's switches to this snapshot."""
        if self.blas is not None and _blas_library() != self.blas:
            torch.backends.cuda.preferred_blas_library(self.blas)
        for name, enabled in self.sdpa:
            _SETTERS[name][1](enabled)
        if self.sdpa_priority is not None:
            torch._C._set_sdp_priority_order(list(self.sdpa_priority))
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.use_deterministic_algorithms(
            self.deterministic_algorithms, warn_only=self.deterministic_warn_only
        )
        torch.backends.cuda.matmul.allow_tf32 = self.tf32_matmul
        torch.backends.cudnn.allow_tf32 = self.tf32_cudnn
        if self.cublas_workspace_config is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config
        if flash_impl() != self.flash_impl:
            use_flash_impl(self.flash_impl)


def _blas_library() -> str | None:
    """``'cublas'`` or ``'cublaslt'`` (None on builds without a choice)."""
    try:
        name = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
    except RuntimeError:
        return None
    return name if name in ("cublas", "cublaslt") else None


def sdpa_priority(first: list[str]) -> tuple[int, ...] | None:
    """PyTorch's SDPA priority order with the backends in ``first`` moved to the front."""
    if not _HAS_PRIORITY:
        return None
    from torch.nn.attention import SDPBackend

    order = list(torch._C._get_sdp_priority_order())
    front = list(dict.fromkeys(int(getattr(SDPBackend, SDPA_BACKENDS[n])) for n in first))
    return tuple(front + [b for b in order if b not in front])


_get_flash, _set_flash = _SETTERS["flash_v2"]
_get_efficient, _set_efficient = _SETTERS["efficient"]
_get_math, _set_math = _SETTERS["math"]
_get_cudnn, _set_cudnn = _SETTERS["cudnn"]
# Kernel name -> the flags (flash, efficient, math, cudnn) with only its backend enabled.
EXCLUSIVE_SDPA = {
    name: tuple(SDPA_BACKENDS[other] == backend for other in _SETTERS)
    for name, backend in SDPA_BACKENDS.items()
}


def flash_impl() -> str | None:
    """The implementation PyTorch's FLASH backend runs: None for its own
    FlashAttention-2, or the name of one activated through
    ``torch.nn.attention.activate_flash_attention_impl`` (FlashAttention-4 for ``flash_v4``)."""
    return _current_flash_impl() if _current_flash_impl is not None else None


def use_flash_impl(impl: str | None) -> None:
    """Make PyTorch's FLASH backend run ``impl`` (None: FlashAttention-2)."""
    from torch.nn import attention

    if impl is None:
        attention.restore_flash_attention_impl(_raise_warn=False)
    else:
        attention.activate_flash_attention_impl(impl)


try:
    from torch.nn.attention import current_flash_attention_impl as _current_flash_impl
except ImportError:  # torch < 2.11
    _current_flash_impl = None


def read_sdpa_flags() -> tuple[bool, bool, bool, bool]:
    """The SDPA backend flags (flash, efficient, math, cudnn), as
    :data:`EXCLUSIVE_SDPA` orders them."""
    return (_get_flash(), _get_efficient(), _get_math(), _get_cudnn())


def write_sdpa_flags(current: tuple[bool, ...], wanted: tuple[bool, ...]) -> None:
    """Set the SDPA backend flags from ``current`` to ``wanted``, writing only those that
    change (this runs around every attention call of ``ops.fused_attention``)."""
    flash, efficient, math, cudnn = wanted
    if current[0] != flash:
        _set_flash(flash)
    if current[1] != efficient:
        _set_efficient(efficient)
    if current[2] != math:
        _set_math(math)
    if current[3] != cudnn:
        _set_cudnn(cudnn)


class only_sdpa_backend:
    """Enable exactly one SDPA backend for the block (PyTorch's ``sdpa_kernel`` context
    manager costs several times as much)."""

    __slots__ = ("_name", "_saved")

    def __init__(self, name: str) -> None:
        self._name = name
        self._saved: tuple[bool, ...] | None = None

    def __enter__(self) -> None:
        saved = read_sdpa_flags()
        write_sdpa_flags(saved, EXCLUSIVE_SDPA[self._name])
        self._saved = saved

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            write_sdpa_flags(read_sdpa_flags(), self._saved)  # whatever the block did
            self._saved = None


_DETERMINISTIC_CUBLAS = ":4096:8"


# -- planning the switches -------------------------------------------------------------------
def plan(
    policy: Any,
    base: Switches,
    decisions: dict[str, Any],
    flash: str | None = None,
    sdpa_refused: str | None = None,
) -> tuple[Switches, list[str]]:
    """The switches that realise ``policy`` (starting from ``base``), and what each does;
    ``flash``: the implementation PyTorch's FLASH backend is to run (FlashAttention-4 for a
    policy naming ``flash_v4`` where it runs), None to leave it; ``sdpa_refused``: why
    the SDPA backend the policy names cannot run here (its switches are then left)."""
    changes: dict[str, Any] = {}
    applied: list[str] = []

    matmul = decisions["matmul"].chosen
    if matmul in ("cublas", "cublasLt"):
        changes["blas"] = matmul.lower()
        applied.append(
            f"matmul={matmul}: torch.backends.cuda.preferred_blas_library({matmul.lower()!r}) "
            "(mm, bmm, baddbmm, addmm without a fused bias)"
        )
    else:
        applied.append(f"matmul=default: PyTorch's BLAS preference left at {base.blas!r}")

    enabled = dict(base.sdpa)
    attention = policy.get("attention")
    if attention == "triton":
        applied.append(
            "attention=triton: our kernel runs in ops.fused_attention (and in the modules "
            "xpuruntime.pytorch.optimize routes there); direct F.scaled_dot_product_attention "
            "calls keep PyTorch's own backend choice"
        )
    elif sdpa_refused is not None:
        applied.append(f"attention={attention}: SDPA switches left as they are ({sdpa_refused})")
    elif attention not in (None, "auto"):
        backend = SDPA_BACKENDS[attention]
        if flash is not None:
            changes["flash_impl"] = flash
            applied.append(
                f"attention={attention}: torch.nn.attention.activate_flash_attention_impl"
                f"({flash!r}): PyTorch's FLASH_ATTENTION backend runs {flash}"
            )
        if policy.strict or backend == "MATH":
            enabled = {name: SDPA_BACKENDS[name] == backend for name in _SETTERS}
            why = "strict" if backend != "MATH" else "it runs anything"
            applied.append(
                f"attention={attention}: only PyTorch's {SDPA_BACKENDS[attention]} SDPA "
                f"backend enabled ({why})"
            )
        else:
            # PyTorch's CPU selector ignores the priority order, so the fallback is made
            # explicit: the named backend, then math (which runs anything).
            enabled = {name: SDPA_BACKENDS[name] in (backend, "MATH") for name in _SETTERS}
            changes["sdpa_priority"] = sdpa_priority([attention, "math"])
            applied.append(
                f"attention={attention}: SDPA backends {SDPA_BACKENDS[attention]} then MATH "
                "enabled, in that priority order (math is the fallback)"
            )

    conv = decisions["conv"].chosen
    if conv == "cudnn_benchmark":
        changes.update(cudnn_benchmark=True, cudnn_deterministic=False)
        applied.append("conv=cudnn_benchmark: torch.backends.cudnn.benchmark = True")
    elif conv == "cudnn_deterministic":
        changes.update(cudnn_benchmark=False, cudnn_deterministic=True)
        applied.append("conv=cudnn_deterministic: torch.backends.cudnn.deterministic = True")

    if policy.deterministic:
        turned_off = []
        if changes.get("cudnn_benchmark", base.cudnn_benchmark):
            turned_off.append("cuDNN autotuning (cudnn.benchmark)")
        if enabled.get("cudnn"):
            turned_off.append("cuDNN attention (non-deterministic backward)")
        enabled["cudnn"] = False
        turned_off.append(
            "non-deterministic cuDNN convolution algorithms (cudnn.deterministic) and every "
            "op PyTorch flags as non-deterministic (torch.use_deterministic_algorithms: "
            "they now raise instead of running)"
        )
        changes.update(
            cudnn_benchmark=False,
            cudnn_deterministic=True,
            deterministic_algorithms=True,
            deterministic_warn_only=False,
        )
        if base.cublas_workspace_config is None:
            changes["cublas_workspace_config"] = _DETERMINISTIC_CUBLAS
            turned_off.append(
                f"cuBLAS split-K reductions across streams (CUBLAS_WORKSPACE_CONFIG="
                f"{_DETERMINISTIC_CUBLAS}; effective for cuBLAS handles created from now on)"
            )
        applied.append("deterministic: turned off " + "; ".join(turned_off))

    if policy.tf32 is not None:
        changes.update(tf32_matmul=policy.tf32, tf32_cudnn=policy.tf32)
        applied.append(
            f"tf32={policy.tf32}: torch.backends.cuda.matmul.allow_tf32 and "
            f"torch.backends.cudnn.allow_tf32 = {policy.tf32}"
        )
    changes["sdpa"] = tuple(enabled.items())
    return replace(base, **changes), applied

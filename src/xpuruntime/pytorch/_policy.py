"""The process-wide kernel policy for PyTorch: set, get, clear, scoped; applied once.

Setting a policy resolves the process-wide ops (matmul, conv) through the dispatcher,
then sets PyTorch's switches in one step (nothing is changed when strict resolution
fails). Attention is resolved per call shape by :func:`ops.fused_attention` and cached
until the policy changes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._errors import PolicyError, UnsupportedOperationError
from .._files import default_cache_dir
from ..kernels import Decision, FallbackWarning, MeasurementCache, dispatcher
from ..policies import KernelPolicy
from ._context import AttentionContext, DeviceContext
from ._kernels import NONDETERMINISTIC_SDPA, auto_order, register_kernels
from ._ranges import annotate
from ._switches import (
    EXCLUSIVE_SDPA,
    SDPA_BACKENDS,
    Switches,
    only_sdpa_backend,
    sdpa_priority,
)
from ._timing import time_call

__all__ = [
    "clear_kernel_policy",
    "current_state",
    "explain_kernel_policy",
    "get_kernel_policy",
    "kernel_policy",
    "resolve_attention",
    "resolve_per_call",
    "set_kernel_policy",
    "traced_choice",
]

logger = logging.getLogger("xpuruntime.pytorch")

_SETTINGS = (
    "auto_strategy", "strict", "deterministic", "tf32", "precision", "cuda_graph",
    "autocast_norms",
)  # fmt: skip
_DETERMINISTIC_CUBLAS = ":4096:8"


@dataclass
class PolicyState:
    """What is in force now. Replaced as a whole, never edited in place."""

    policy: KernelPolicy | None = None
    generation: int = 0
    decisions: dict[str, Decision] = field(default_factory=dict)
    applied: tuple[str, ...] = ()


_lock = threading.RLock()
_state = PolicyState()
_base: Switches | None = None  # PyTorch's switches before the first policy
# Attention's per-call decisions, emptied (in place) whenever the policy changes (the
# routed ops keep theirs, keyed on the policy's generation).
_attention: dict[tuple, Decision] = {}
# What ops.fused_attention's call path needs per cached attention decision (same keys).
_attention_plans: dict[tuple, tuple] = {}
# The policy's named SDPA kernel, for ops.fused_attention's shortest call path: (its
# exclusive SDPA flags, whether its backward is non-deterministic, its name). Slot 1 holds
# it from the policy's start; slot 0 arms the path once a call has resolved to that kernel
# (so that a policy PyTorch refuses from the first call never tries it), and both empty
# once a call has needed another kernel.
named_attention: list[tuple | None] = [None, None]


def _named_attention(policy: KernelPolicy | None) -> tuple | None:
    name = None if policy is None else policy.get("attention")
    if name not in SDPA_BACKENDS:
        return None
    return (EXCLUSIVE_SDPA[name], name in NONDETERMINISTIC_SDPA, name)


def _forget_per_call() -> None:
    _attention.clear()
    _attention_plans.clear()


def current_state() -> PolicyState:
    """The policy in force, its process-wide decisions and what was applied."""
    return _state


# -- the public API ------------------------------------------------------------------------
def set_kernel_policy(
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    **op_kernels: Any,
) -> KernelPolicy | None:
    """Make ``policy`` (with ``op_kernels`` on top) the process-wide kernel policy.

    Parameters
    ----------
    policy : KernelPolicy, dict, path or None
        A policy object, its dict form, or a JSON/YAML file written by
        :meth:`KernelPolicy.save`. None with no ``op_kernels`` removes the policy, as
        the seed documents say (:func:`clear_kernel_policy`; :func:`get_kernel_policy`
        then returns None); None with ``op_kernels`` starts from an empty policy.
    **op_kernels
        ``op=kernel`` pairs (``matmul="cublasLt"``, ``attention="flash_v2"``,
        ``conv="cudnn_benchmark"``) and the settings ``auto_strategy``, ``strict``,
        ``deterministic``, ``tf32``; they override ``policy``.

    Returns
    -------
    KernelPolicy or None
        A copy of the policy now in force (None once removed).

    Raises
    ------
    PolicyError
        An unknown op, kernel or setting (the message lists the choices).
    UnsupportedOperationError, BackendUnavailableError
        ``strict`` and a named matmul/conv kernel cannot run on this machine, or
        ``attention="cudnn"`` with ``deterministic``. Nothing is changed then.

    Examples
    --------
    >>> from xpuruntime import pytorch as xpt                        # doctest: +SKIP
    >>> xpt.set_kernel_policy(matmul="cublasLt", attention="flash_v2")  # doctest: +SKIP
    KernelPolicy(attention='flash_v2', matmul='cublasLt')
    """
    global _state, _base
    if policy is None and not op_kernels:
        _check_ranks(None)
        clear_kernel_policy()
        return None
    new = _coerce(policy, op_kernels)
    _check_ranks(new)
    register_kernels()
    with _lock:
        named_attention[:] = [None, None]  # no shortest path while the switches change
        base = _base if _base is not None else Switches.capture()
        with annotate(f"set_kernel_policy {new!r}"):
            decisions = _resolve_process_wide(new)
            switches, applied = _plan(new, base, decisions)
            switches.apply()
        _base = base
        _forget_per_call()
        _state = PolicyState(_copy(new), _state.generation + 1, decisions, tuple(applied))
        named_attention[:] = [None, _named_attention(new)]
    logger.info("kernel policy %r applied: %s", new, "; ".join(applied))
    return _copy(new)


def get_kernel_policy() -> KernelPolicy | None:
    """A copy of the policy in force, or None when none is set."""
    policy = _state.policy
    return None if policy is None else _copy(policy)


def clear_kernel_policy() -> None:
    """Remove the policy and put PyTorch's switches back as they were before it."""
    global _state, _base
    with _lock:
        named_attention[:] = [None, None]
        if _base is not None:
            with annotate("clear_kernel_policy"):
                _base.apply()
        _base = None
        _forget_per_call()
        _state = PolicyState(None, _state.generation + 1)
    logger.info("kernel policy cleared")


@contextlib.contextmanager
def kernel_policy(
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    **op_kernels: Any,
) -> Iterator[KernelPolicy]:
    """Apply a policy for the block, then restore the previous one (in ``finally``).

    The policy is process-wide, like the switches under it: other threads see it while
    the block runs. Blocks must nest; if something else changed the policy inside the
    block, the previous policy is restored anyway and a RuntimeWarning says so.

    Examples
    --------
    >>> with xpt.kernel_policy(attention="math", strict=True):   # doctest: +SKIP
    ...     loss = model(batch).sum()
    """
    previous = _state.policy
    applied = set_kernel_policy(policy, **op_kernels)
    try:
        yield applied
    finally:
        if _state.policy != applied:
            warnings.warn(
                "the kernel policy changed inside a kernel_policy block (another thread or "
                "a set/clear_kernel_policy call); restoring the policy from before the block",
                RuntimeWarning,
                stacklevel=3,
            )
        if previous is None:
            clear_kernel_policy()
        else:
            set_kernel_policy(previous)


_ranks_checked: str | None = None


def _check_ranks(policy: KernelPolicy | None) -> None:
    """Under torch.distributed, every rank must set the same policy (a collective: every
    rank calls this with the same sequence of policy changes)."""
    global _ranks_checked
    from . import distributed

    if not distributed.is_initialized():
        return
    distributed.check_policy(policy)
    _ranks_checked = (
        f"the same policy on all {distributed.world_size()} ranks (checked when set); "
        "best_performance choices are rank 0's"
    )


def explain_kernel_policy() -> str:
    """The policy in force, what it set in PyTorch, and its decisions, for a person."""
    state = _state
    if state.policy is None:
        return "no kernel policy set: PyTorch's own switches are in force"
    lines = [f"kernel policy {state.policy!r} (fingerprint {state.policy.fingerprint()})"]
    if _ranks_checked is not None:
        from .distributed import last_comparison

        lines.append(f"  ranks: {_ranks_checked}")
        if last_comparison is not None:
            lines.append(f"  ranks' logs: {last_comparison}")
    lines += [f"  set: {line}" for line in state.applied]
    lines += [decision.explain() for decision in state.decisions.values()]
    from ._routed import ROUTED_OPS

    per_call = {"attention": list(_attention.values())}
    per_call.update({op: list(routed.decisions.values()) for op, routed in ROUTED_OPS.items()})
    for op, decisions in per_call.items():
        if decisions:
            lines.append(f"{op}: {len(decisions)} call shape(s) resolved so far:")
            lines += [f"  {d.chosen} ({d.source}): {d.reason}" for d in decisions]
    return "\n".join(lines)


# -- per-call resolution (attention, norms) ------------------------------------------------
def resolve_attention(key: tuple | None, ctx: AttentionContext) -> Decision:
    """The attention kernel for one call signature ``key`` (cached until the policy
    changes; None: not cached)."""
    state = _state
    decision = resolve_per_call(
        "attention", ctx, auto_order("attention"), lambda k: _time_attention(k.name, ctx)
    )
    with _lock:
        if _state is state and key is not None:  # not changed meanwhile by another thread
            _attention[key] = decision
    return decision


def resolve_per_call(
    op: str, ctx: Any, order: list[str], measure: Callable[[Any], float]
) -> Decision:
    """The kernel the policy in force gives a per-call op for the call described by
    ``ctx`` (which has ``device`` and ``shape_class``)."""
    register_kernels()
    with _lock:
        state = _state
        policy = state.policy or KernelPolicy()
        strategy = policy.auto_strategy
        with annotate(f"resolve {op}"):
            decision = dispatcher.select(
                op,
                ctx,
                requested=policy.get(op),
                strategy=strategy,
                strict=policy.strict,
                order=order,
                measure=measure,
                cache=_measurements() if strategy == "best_performance" else None,
                cache_key=_measurement_key(op, ctx.device, ctx.shape_class),
            )
    return decision


def traced_choice(
    op: str, device: torch.device, traced_auto: Callable[[torch.device], str] | None = None
) -> str:
    """The kernel of a per-call op inside a torch.compile trace, where nothing may be
    measured: the policy's named kernel, and for ``auto`` ``traced_auto(device)`` (by
    default ``fused`` where Triton runs)."""
    policy = _state.policy
    named = None if policy is None else policy.get(op)
    if named not in (None, "auto"):
        return named
    if traced_auto is not None:
        return traced_auto(device)
    from .ops._launch import triton_unavailable

    return "fused" if triton_unavailable(device) is None else "torch"


def _time_attention(name: str, ctx: AttentionContext) -> float:
    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(t).requires_grad_(ctx.requires_grad)

    q, k, v = fresh(ctx.query), fresh(ctx.key), fresh(ctx.value)
    grad = torch.randn_like(q) if ctx.requires_grad else None
    kwargs = {"enable_gqa": True} if ctx.enable_gqa else {}

    def step() -> None:
        if name == "triton":
            from .ops.flash_attention import flash_attention

            out = flash_attention(q, k, v, ctx.is_causal)
        else:
            with only_sdpa_backend(name):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, ctx.attn_mask, ctx.dropout_p, ctx.is_causal, **kwargs
                )
        if grad is not None:
            out.backward(grad)

    with torch.enable_grad() if ctx.requires_grad else torch.no_grad():
        return time_call(step, ctx.device)


# -- process-wide resolution (matmul, conv) ------------------------------------------------
def _target_device() -> torch.device:
    # torch.cuda.is_available() does not create a CUDA context (an allocator choice made
    # later must still be possible), and the index does not change what is supported.
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_process_wide(policy: KernelPolicy) -> dict[str, Decision]:
    ctx = DeviceContext(_target_device(), policy.deterministic)
    measured = policy.auto_strategy == "best_performance" and ctx.device.type == "cuda"
    decisions = {
        "matmul": dispatcher.select(
            "matmul",
            ctx,
            requested=policy.get("matmul"),
            strategy="best_performance" if measured else "first_supported",
            strict=policy.strict,
            order=auto_order("matmul"),
            measure=lambda kernel: _time_matmul(kernel.name, ctx.device),
            cache=_measurements() if measured else None,
            cache_key=_measurement_key("matmul", ctx.device, {"shapes": _MATMUL_SHAPES}),
        ),
        # cudnn_benchmark is itself the measured choice, so conv's auto never measures.
        "conv": dispatcher.select(
            "conv",
            ctx,
            requested=policy.get("conv"),
            strict=policy.strict,
            order=auto_order("conv"),
        ),
    }
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


def _time_matmul(name: str, device: torch.device) -> float:
    """The geometric mean of the seconds per GEMM over :data:`_MATMUL_SHAPES`: every
    shape weighs alike in the comparison (a sum would let the largest GEMM decide; on an
    H200 the libraries tie within 1% on large GEMMs, and cuBLAS's lower per-call cost
    shows on small ones)."""
    library = {"cublas": "cublas", "cublasLt": "cublaslt"}.get(name, _base_blas())
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


def _base_blas() -> str:
    base = _base or Switches.capture()
    return base.blas or "cublas"


def _measurements() -> MeasurementCache:
    return MeasurementCache(default_cache_dir() / "kernel-selection")


def _measurement_key(op: str, device: torch.device, shape_class: dict[str, Any]) -> str:
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
        },
        sort_keys=True,
    )


# -- planning the switches -------------------------------------------------------------------
def _plan(
    policy: KernelPolicy, base: Switches, decisions: dict[str, Decision]
) -> tuple[Switches, list[str]]:
    """The switches that realise ``policy`` (starting from ``base``), and what each does."""
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
    elif attention not in (None, "auto"):
        if policy.strict:
            enabled = {name: name == attention for name in SDPA_BACKENDS}
            applied.append(
                f"attention={attention}: only PyTorch's {SDPA_BACKENDS[attention]} SDPA "
                "backend enabled (strict)"
            )
        else:
            # PyTorch's CPU selector ignores the priority order, so the fallback is made
            # explicit: the named backend, then math (which runs anything).
            enabled = {name: name in (attention, "math") for name in SDPA_BACKENDS}
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


def _coerce(policy: Any, op_kernels: dict[str, Any]) -> KernelPolicy:
    if policy is None:
        result = KernelPolicy()
    elif isinstance(policy, KernelPolicy):
        result = _copy(policy)
    elif isinstance(policy, Mapping):
        result = KernelPolicy.from_dict(dict(policy))
    elif isinstance(policy, (str, os.PathLike)):
        result = KernelPolicy.load(policy)
    else:
        raise PolicyError(
            "policy: expected a KernelPolicy, a dict, a path to a policy file or None, "
            f"got {type(policy).__name__}"
        )
    for name, value in op_kernels.items():
        if name in _SETTINGS:
            setattr(result, name, value)
        else:
            result.set(name, value)
    return result


def _copy(policy: KernelPolicy) -> KernelPolicy:
    return KernelPolicy.from_dict(policy.to_dict())

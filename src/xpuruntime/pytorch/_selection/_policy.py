"""The process-wide kernel policy for PyTorch: set, get, clear, scoped; its state.

Setting a policy resolves the process-wide ops (matmul, conv) through the dispatcher,
then sets PyTorch's switches in one step (nothing is changed when strict resolution
fails). The per-call ops (:class:`~._routed.RoutedOp`: attention, the norms, linear, ...)
resolve each call signature through :func:`resolve_per_call` and are told to forget
their decisions whenever the policy changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..._errors import BackendUnavailableError, PolicyError
from ...kernels import Decision, dispatcher
from ...policies import KernelPolicy
from .._kernels import register_kernels
from .._kernels._switches import Switches, plan
from .._kernels.fp8 import PRECISIONS
from ._ranges import annotate
from ._resolution import (
    as_frozen,
    flash_impl_for,
    measurement_key,
    measurements,
    requested_kernel,
    resolve_process_wide,
    sdpa_backend_refusal,
)

__all__ = [
    "PerCallOp",
    "add_per_call_op",
    "by_gpu_time",
    "clear_kernel_policy",
    "current_state",
    "explain_kernel_policy",
    "forget_measured_decisions",
    "freeze_kernel_policy",
    "get_kernel_policy",
    "kernel_policy",
    "per_call_ops",
    "ranking_by_gpu_time",
    "resolve_per_call",
    "set_kernel_policy",
    "torch_under_compile",
    "traced_choice",
]

logger = logging.getLogger("xpuruntime.pytorch")

_SETTINGS = (
    "auto_strategy", "strict", "deterministic", "tf32", "precision", "cuda_graph",
    "autocast_norms", "offload_activations", "fp8_base", "fp8_activations", "packed_sequences",
    "graph_layers",
)  # fmt: skip


@dataclass
class PolicyState:
    """What is in force now. Replaced as a whole, never edited in place."""

    policy: KernelPolicy | None = None
    generation: int = 0
    decisions: dict[str, Decision] = field(default_factory=dict)
    applied: tuple[str, ...] = ()


class PerCallOp(Protocol):
    """An op resolved per call (a :class:`~._routed.RoutedOp`), as the policy sees it."""

    op: str

    @property
    def decisions(self) -> dict[tuple, Decision]: ...

    @property
    def decided(self) -> list[tuple[dict[str, Any], Decision]]: ...

    def forget(self, state: PolicyState) -> None: ...


_lock = threading.RLock()
_state = PolicyState()
_base: Switches | None = None  # PyTorch's switches before the first policy
per_call_ops: dict[str, PerCallOp] = {}
"""The ops resolved per call, by policy op name (told of every policy change)."""


def add_per_call_op(op: PerCallOp) -> None:
    """Tell ``op`` of the policy in force now and of every change from now on."""
    with _lock:
        per_call_ops[op.op] = op
        op.forget(_state)


def _changed(state: PolicyState) -> None:
    """Make ``state`` the one in force (under the lock) and tell the per-call ops."""
    global _state
    _state = state
    dispatcher.strict = state.policy is not None and state.policy.strict
    for op in per_call_ops.values():
        op.forget(state)


def current_state() -> PolicyState:
    """The policy in force, its process-wide decisions and what was applied."""
    return _state


_by_gpu_time = False  # best_performance ranks by GPU time alone (graph replays)


@contextlib.contextmanager
def by_gpu_time(afresh: bool = True) -> Iterator[None]:
    """Within the block, ``best_performance`` ranks a per-call op's kernels by their GPU
    time alone: each candidate is timed as replays of a captured call, which is what a
    call costs inside a CUDA graph (the host launches nothing per kernel), rather than
    as eager calls, where a small op's host time per launch decides. Its measurements
    have keys of their own. With ``afresh``, decisions made before the block are made
    again within it. Decisions made within stay in force after it, until the policy
    changes (a graph replays them). A graph's warm-up runs in such a block, and so do
    the steps of an eager :class:`TrainStep` that ran faster with such choices."""
    global _by_gpu_time
    with _lock:
        previous = _by_gpu_time
        if afresh and not previous:
            forget_measured_decisions()
        _by_gpu_time = True
    try:
        yield
    finally:
        _by_gpu_time = previous


def ranking_by_gpu_time() -> bool:
    """Whether ``best_performance`` ranks kernels by GPU time now (:func:`by_gpu_time`)."""
    return _by_gpu_time


def forget_measured_decisions() -> None:
    """Have the per-call ops decide again where the policy in force measures
    (``best_performance``); their measurements are kept, so deciding again is a lookup."""
    with _lock:
        policy = _state.policy
        if policy is not None and policy.auto_strategy == "best_performance":
            _changed(replace(_state, generation=_state.generation + 1))


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
    global _base
    if policy is None and not op_kernels:
        _check_ranks(None)
        clear_kernel_policy()
        return None
    new = _coerce(policy, op_kernels)
    _check_ranks(new)
    register_kernels()
    with _lock:
        base = _base if _base is not None else Switches.capture()
        with annotate(f"set_kernel_policy {new!r}"):
            decisions = resolve_process_wide(new, base)
            refused = sdpa_backend_refusal(new)
            switches, applied = plan(new, base, decisions, flash_impl_for(new), refused)
            switches.apply()
        _base = base
        _changed(PolicyState(_copy(new), _state.generation + 1, decisions, tuple(applied)))
    logger.info("kernel policy %r applied: %s", new, "; ".join(applied))
    return _copy(new)


def get_kernel_policy() -> KernelPolicy | None:
    """A copy of the policy in force, or None when none is set."""
    policy = _state.policy
    return None if policy is None else _copy(policy)


def clear_kernel_policy() -> None:
    """Remove the policy and put PyTorch's switches back as they were before it."""
    global _base
    with _lock:
        if _base is not None:
            with annotate("clear_kernel_policy"):
                _base.apply()
        _base = None
        _changed(PolicyState(None, _state.generation + 1))
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
    from ..distributed import _ranks as distributed

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
        from ..distributed._ranks import last_comparison

        lines.append(f"  ranks: {_ranks_checked}")
        if last_comparison is not None:
            lines.append(f"  ranks' logs: {last_comparison}")
    lines += [f"  set: {line}" for line in state.applied]
    lines += [decision.explain() for decision in state.decisions.values()]
    for per_call in per_call_ops.values():
        decisions = list(per_call.decisions.values())
        if decisions:
            lines.append(f"{per_call.op}: {len(decisions)} call shape(s) resolved so far:")
            lines += [f"  {d.chosen} ({d.source}): {d.reason}" for d in decisions]
    return "\n".join(lines)


# -- per-call resolution (the routed ops) ----------------------------------------------------
def resolve_per_call(
    op: str,
    ctx: Any,
    order: list[str],
    measure: Callable[[Any], float],
    unmeasured: str | None = None,
) -> Decision:
    """The kernel the policy in force gives a per-call op for the call described by
    ``ctx`` (which has ``device`` and ``shape_class``); ``unmeasured``: why the op's
    kernels are not timed alone (``best_performance`` then keeps the first supported)."""
    register_kernels()
    with _lock:
        state = _state
        policy = state.policy or KernelPolicy()
        strategy = policy.auto_strategy
        if unmeasured is not None:
            strategy = "first_supported"
        replayed = _by_gpu_time and ctx.device.type == "cuda"
        requested, frozen = requested_kernel(policy, op, ctx.shape_class)
        if requested is None:
            order = precision_order(policy, op, ctx, order)
        with annotate(f"resolve {op}"):
            decision = dispatcher.select(
                op,
                ctx,
                requested=requested,
                strategy=strategy,
                strict=policy.strict,
                order=order,
                measure=measure,
                cache=measurements() if strategy == "best_performance" else None,
                cache_key=measurement_key(op, ctx.device, ctx.shape_class, replayed),
            )
    if order and order[0] in PRECISIONS and decision.chosen != order[0]:
        why = dict(decision.rejected).get(order[0])
        decision = replace(decision, reason=f"{decision.reason}; not {order[0]}: {why}")
    if replayed and decision.measurements:
        decision = replace(decision, reason=f"{decision.reason} (as CUDA-graph replays)")
    if unmeasured is not None and policy.auto_strategy == "best_performance":
        decision = replace(decision, reason=f"{decision.reason}; not measured: {unmeasured}")
    return as_frozen(decision, frozen)


def precision_order(policy: KernelPolicy, op: str, ctx: Any, order: list[str]) -> list[str]:
    """``auto``'s order for ``op`` under the policy's precision: with ``fp8`` (or
    ``fp8_rowwise``) the op's kernel of that name first (an op without a kernel per
    recipe: its ``fp8`` one), so that each call runs FP8 where its shape pays and the
    device has FP8, and the next kernel otherwise, the reason in the log. Under
    ``strict`` a device without FP8 raises.

    Raises
    ------
    BackendUnavailableError
        ``strict`` and a device without FP8 GEMMs (the CPU, compute capability < 8.9).
    """
    from .._kernels.fp8 import fp8_refusal  # (looked up per call, as every caller does)

    precision = policy.precision
    first = precision if precision in order else PRECISIONS[0]
    if precision not in PRECISIONS or first not in order:
        return order
    if policy.strict:
        why = fp8_refusal(ctx.device)
        if why is not None:
            raise BackendUnavailableError(
                f"precision={precision!r}: {why} (strict mode, so no bf16 fallback)"
            )
    return [first, *(name for name in order if name not in PRECISIONS)]


def freeze_kernel_policy() -> KernelPolicy:
    """The policy in force with every decision made so far for ops it leaves to
    ``auto`` written in as frozen decisions (:meth:`KernelPolicy.freeze`), per shape
    class: process-wide (matmul, conv) and per call (the norms, linear, attention, the
    loss, ...). Save it, and load it in another process or on another machine, for the
    same kernels without measuring anything again.

    Returns
    -------
    KernelPolicy
        A new policy (the one in force is not changed); with no policy set, the default
        one, with the decisions made under it.

    Examples
    --------
    >>> xpt.set_kernel_policy(auto_strategy="best_performance")     # doctest: +SKIP
    >>> train_a_few_steps()                                         # doctest: +SKIP
    >>> xpt.freeze_kernel_policy().save("policy.json")              # doctest: +SKIP
    """
    with _lock:
        state = _state
        frozen = _copy(state.policy or KernelPolicy())
        decided = [({}, d) for d in state.decisions.values()]
        for per_call in per_call_ops.values():
            decided += per_call.decided
    for shape_class, decision in decided:
        if decision.source == "auto":  # frozen ones are in the copy already
            reason = f"{decision.strategy}: {decision.reason}"
            frozen.freeze(decision.op, shape_class, decision.chosen, reason)
    return frozen


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
    from .._ops._infra._launch import triton_unavailable

    return "fused" if triton_unavailable(device) is None else "torch"


def torch_under_compile(device: torch.device) -> str:
    """``auto`` inside a torch.compile trace for an op whose torch form inductor compiles
    well on its own: torch's. For the norms, rope and SwiGLU/GeGLU inductor fuses that
    form into the elementwise code around it, where our fused kernel would stay an opaque
    call between its fusions: optimize then compile on one H100 (B4 x T2048) went
    162.3 -> 148.3 ms on the Gemma3-1B shape, 205.6 -> 203.3 on Qwen3-1.7B, 138.8 -> 138.0
    on Llama-3.2-1B, at the same peak memory."""
    return "torch"


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

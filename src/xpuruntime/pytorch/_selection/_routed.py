"""RoutedOp: one op of the kernel policy whose kernel is chosen per call signature, then
runs itself.

A routed op owns, for its op: the cache from call signature to the chosen kernel's
runner (emptied whenever the policy changes), the ``torch.compile`` branch (nothing is
measured inside a trace: the policy's named kernel runs, and ``auto`` the op's traced
default), resolution through the shared :class:`~xpuruntime.kernels.Dispatcher` (the
policy's choice, its fallback or ``auto``; strict mode raises with the reasons), and the
call of the chosen kernel object. An op is a declaration: how to key a call, the context
its kernels' ``supports`` read, and fresh arguments to time a kernel on.

A cached call costs the signature tuple, one dict lookup and the kernel's runner. Where
the policy names a kernel with a :meth:`~._kernels.TorchKernel.direct` runner (one that
refuses what it cannot run), a call goes straighter once a call has resolved to that
kernel: the runner first, and a refused call resolved as above. The short path is left
for good (until the policy changes) once a call has needed another kernel, so that
calls the kernel refuses do not pay for a refusal each time. While the dispatch log
records or a profile is open, every call takes the resolved path, under a range named
``<op>[<kernel>]`` and with its decision on the records of the ops it runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...kernels import Decision, registry
from .._kernels import auto_order, register_kernels
from ._logging import observed, running
from ._policy import (
    PolicyState,
    add_per_call_op,
    per_call_ops,
    ranking_by_gpu_time,
    resolve_per_call,
    traced_choice,
)
from ._ranges import annotate
from ._timing import time_training_call

__all__ = ["MAX_SIGNATURES", "ROUTED_OPS", "RoutedOp"]

ROUTED_OPS: dict[str, RoutedOp] = per_call_ops  # type: ignore[assignment]
"""Every routed op by its policy op name (the policy's own table of them)."""

MAX_SIGNATURES = 1024
"""The most call signatures an op keeps resolved (a model meets a few dozen; a workload
of ever-new shapes would otherwise grow the table, and the runners it holds, without
end). Past it the oldest is dropped, and resolved again if it returns."""

_compiling = torch.compiler.is_compiling
_lock = threading.Lock()


class RoutedOp:
    """A policy op: ``op(*args)`` runs the kernel the policy chooses for ``args``.

    Parameters
    ----------
    op : str
        The policy's op name (``"layernorm"``, ...); its kernels are the registry's.
    signature : callable
        ``signature(*args)``: a hashable key of everything the choice depends on.
    context : callable
        ``context(*args)``: what the kernels' ``supports`` read (``device``,
        ``shape_class`` and ``requires_grad`` attributes).
    sample : callable
        ``sample(ctx, *args)``: ``(args, leaves)``, fresh arguments shaped as the call's
        to time a kernel on under ``best_performance``, and the tensors whose gradients
        it fills.
    check : callable, optional
        ``check(*args)``: raise :class:`~xpuruntime.InvalidInputError` naming what is
        wrong with a call's arguments; run before a signature is resolved, and when one
        cannot be formed.
    traced_auto : callable, optional
        ``traced_auto(device)``: the kernel ``auto`` means inside a torch.compile trace
        (default: ``fused`` where Triton runs, else ``torch``).
    traced : callable, optional
        ``traced(*args)``: the whole call inside a torch.compile trace, where the op's
        kernels cannot be run as objects (default: the traced choice's runner).
    around : callable, optional
        ``around(ctx)``: a context manager the timing runs are made in (autocast).
    unmeasured : str, optional
        Why the op's kernels are not timed alone, where what they save lies in the ops
        around them (``best_performance`` keeps the first supported and says why).
    """

    def __init__(
        self,
        op: str,
        *,
        signature: Callable[..., tuple],
        context: Callable[..., Any],
        sample: Callable[..., tuple[tuple, list[torch.Tensor]]],
        check: Callable[..., None] | None = None,
        traced_auto: Callable[[torch.device], str] | None = None,
        traced: Callable[..., Any] | None = None,
        around: Callable[[Any], contextlib.AbstractContextManager] | None = None,
        unmeasured: str | None = None,
    ) -> None:
        self.op = op
        self._signature = signature
        self._context = context
        self._sample = sample
        self._check = check or (lambda *args: None)
        self._traced_auto = traced_auto
        self._traced = traced
        self._around = around or (lambda ctx: contextlib.nullcontext())
        self._unmeasured = unmeasured
        # runner, why, the call's shape class (what a frozen policy records it under)
        self._plans: dict[tuple, tuple[Callable[..., Any], Decision, dict]] = {}
        self._generation = -1
        self._direct: Callable[..., Any] | None = None  # armed short path
        self._named: str | None = None  # the policy's kernel, when it has a short path
        # Registered now, not at the first eager call: a first call inside a torch.compile
        # trace looks its kernel up in the registry and must find it there.
        register_kernels()
        add_per_call_op(self)

    @property
    def decisions(self) -> dict[tuple, Decision]:
        """The decision for each call signature met under the policy in force."""
        return {key: decision for key, (_, decision, _) in list(self._plans.items())}

    @property
    def decided(self) -> list[tuple[dict[str, Any], Decision]]:
        """Each call signature's shape class and decision, under the policy in force."""
        # A snapshot first (one C call): another thread may be adding a signature.
        plans = list(self._plans.values())
        return [(shape_class, decision) for _, decision, shape_class in plans]

    @property
    def short_path(self) -> str | None:
        """The kernel whose direct runner takes calls first (None: each call is
        resolved by its signature)."""
        return self._named if self._direct is not None else None

    def __call__(self, *args: Any) -> Any:
        if _compiling():
            if self._traced is not None:
                return self._traced(*args)
            name = traced_choice(self.op, _device(args), self._traced_auto)
            return registry.get(self.op, name).run(*args)
        direct = self._direct
        if direct is not None and not observed():
            try:
                return direct(*args)
            except Exception:  # refused (or bad input): resolved below, which says why
                pass
        try:
            key = self._signature(*args)
        except (AttributeError, TypeError, IndexError):
            self._check(*args)  # our error, naming what is wrong
            raise
        runner, decision, _ = self._plans.get(key) or self._resolve(key, args)
        if not observed():
            return runner(*args)
        with running(decision), annotate(f"{self.op}[{decision.chosen}]"):
            return runner(*args)

    def forget(self, state: PolicyState) -> None:
        """The policy changed: forget every decision (called under the policy's lock)."""
        named = None if state.policy is None else state.policy.get(self.op)
        if named not in registry.names(self.op) or registry.get(self.op, named).direct() is None:
            named = None
        with _lock:
            self._plans = {}
            self._generation = state.generation
            self._direct, self._named = None, named

    def _resolve(self, key: tuple, args: tuple) -> tuple[Callable[..., Any], Decision, dict]:
        register_kernels()
        generation = self._generation
        self._check(*args)
        ctx = self._context(*args)

        def time(kernel: Any) -> float:
            return self._time(kernel.timed(kernel.planned(ctx)), ctx, args)

        decision = resolve_per_call(self.op, ctx, auto_order(self.op), time, self._unmeasured)
        kernel = registry.get(self.op, decision.chosen)
        # A runner of its own, not the timed one: a launch plan derived from the timing's
        # fresh samples (contiguous) would refuse the model's calls (a q/k norm's per-head
        # views), which would then take the Python launches for good.
        runner = kernel.planned(ctx)
        with _lock:
            if self._generation == generation:  # not if the policy changed meanwhile
                if len(self._plans) >= MAX_SIGNATURES:  # the oldest goes (dicts keep order)
                    del self._plans[next(iter(self._plans))]
                self._plans[key] = (runner, decision, ctx.shape_class)
                if self._named is not None:  # arm the short path, or leave it for good
                    if decision.chosen == self._named and self._direct is None:
                        self._direct = kernel.direct()
                    elif decision.chosen != self._named:
                        self._direct, self._named = None, None
        return runner, decision, ctx.shape_class

    def _time(self, runner: Callable[..., Any], ctx: Any, call: tuple) -> float:
        args, leaves = self._sample(ctx, *call)

        def run() -> torch.Tensor | tuple[torch.Tensor, ...]:
            with self._around(ctx):
                return runner(*args)

        return time_training_call(
            run, leaves, ctx.device, backward=ctx.requires_grad, replayed=ranking_by_gpu_time()
        )


def _device(args: tuple) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))

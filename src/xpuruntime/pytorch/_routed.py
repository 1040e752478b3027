"""RoutedOp: one op of the kernel policy whose kernel is chosen per call signature, then
runs itself.

A routed op owns, for its op: the cache from call signature to the chosen kernel's
runner (emptied when the policy's generation changes), the ``torch.compile`` branch
(nothing is measured inside a trace: the policy's named kernel runs, and ``auto`` the
op's traced default), resolution through the shared :class:`~xpuruntime.kernels.Dispatcher`
(the policy's choice, its fallback or ``auto``; strict mode raises with the reasons), and
the call of the chosen kernel object. An op is a declaration: how to key a call, the
context its kernels' ``supports`` read, and fresh arguments to time a kernel on.

A cached call costs the signature tuple, one dict lookup and the kernel's runner.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..kernels import Decision, registry
from ._kernels import auto_order, register_kernels
from ._policy import current_state, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["ROUTED_OPS", "RoutedOp"]

ROUTED_OPS: dict[str, RoutedOp] = {}
"""Every routed op by its policy op name (what :func:`explain_kernel_policy` lists)."""

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
    traced_auto : callable, optional
        ``traced_auto(device)``: the kernel ``auto`` means inside a torch.compile trace
        (default: ``fused`` where Triton runs, else ``torch``).
    around : callable, optional
        ``around(ctx)``: a context manager the timing runs are made in (autocast).
    """

    def __init__(
        self,
        op: str,
        *,
        signature: Callable[..., tuple],
        context: Callable[..., Any],
        sample: Callable[..., tuple[tuple, list[torch.Tensor]]],
        traced_auto: Callable[[torch.device], str] | None = None,
        around: Callable[[Any], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.op = op
        self._signature = signature
        self._context = context
        self._sample = sample
        self._traced_auto = traced_auto
        self._around = around or (lambda ctx: contextlib.nullcontext())
        self._runners: dict[tuple, Callable[..., Any]] = {}
        self._decisions: dict[tuple, Decision] = {}
        self._generation = -1
        ROUTED_OPS[op] = self

    @property
    def decisions(self) -> dict[tuple, Decision]:
        """The decision for each call signature met under the policy in force."""
        self._refresh(current_state().generation)
        return dict(self._decisions)

    def __call__(self, *args: Any) -> Any:
        if _compiling():
            name = traced_choice(self.op, _device(args), self._traced_auto)
            return registry.get(self.op, name).run(*args)
        generation = current_state().generation
        if generation != self._generation:
            self._refresh(generation)
        key = self._signature(*args)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._resolve(key, args, generation)
        return runner(*args)

    def _refresh(self, generation: int) -> None:
        with _lock:
            if generation != self._generation:
                self._runners, self._decisions = {}, {}
                self._generation = generation

    def _resolve(self, key: tuple, args: tuple, generation: int) -> Callable[..., Any]:
        register_kernels()
        ctx = self._context(*args)
        decision = resolve_per_call(
            self.op, ctx, auto_order(self.op), lambda k: self._time(k, ctx, args)
        )
        runner = registry.get(self.op, decision.chosen).runner()
        with _lock:
            if self._generation == generation:  # not if the policy changed meanwhile
                self._runners[key] = runner
                self._decisions[key] = decision
        return runner

    def _time(self, kernel: Any, ctx: Any, call: tuple) -> float:
        args, leaves = self._sample(ctx, *call)

        def run() -> torch.Tensor:
            with self._around(ctx):
                out = kernel.run(*args)
            return out[-1] if isinstance(out, tuple) else out

        return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)


def _device(args: tuple) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))

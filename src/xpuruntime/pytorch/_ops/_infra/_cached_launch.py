"""Launching a compiled Triton kernel without Triton's per-call Python work.

``kernel[grid](*args)`` binds the arguments, computes their specialisation, looks the
compiled kernel up, checks the globals it read and builds launch metadata: about 12 µs
of host time per launch on an H200 host (Triton 3.6; the launch itself is ~7 µs), which
is most of what a small norm costs. :func:`cached_launch` wraps a ``@triton.jit``
function so that, after Triton has compiled and run it once for a specialisation, later
calls with the same specialisation go straight to the compiled kernel's launcher.

The key is a superset of what Triton specialises on (each tensor's dtype and 16-byte
alignment; each int's 32/64-bit class, whether it is 1 and whether it divides by 16;
the constexprs, ``num_warps``/``num_stages`` and the current device), so a hit runs the
very binary Triton would have chosen, with Triton's launch hooks called as Triton calls
them. Triton does the first launch of every key, every launch under the interpreter,
and every launch once a direct one has been refused (a Triton whose launcher API
differs: then the direct path is switched off for the process). Under the interpreter
launches run one at a time: it keeps the grid, and its stand-ins for ``triton.language``,
in module state that threads would share.

While a thread derives a launch plan (:func:`plan_launches`, used by :mod:`._native`),
its launches launch nothing: each is compiled with Triton's warm-up API (the binary
Triton would launch) and handed to the planner with its grid and argument values.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs

from ._launch import interpreting

__all__ = [
    "CachedLaunch",
    "cached_launch",
    "plan_launches",
    "planning",
    "specialisation",
]

_log = logging.getLogger("xpuruntime.pytorch.ops")
_I32 = (-(2**31), 2**31)
_I64 = 2**63
_direct = True  # turned off for the process if the compiled launcher's API differs
_interpreter = threading.Lock()  # one interpreted launch at a time (the module's text)


class _Planning(threading.local):
    """This thread's planner: a list of (compiled kernel, grid, argument values) while a
    plan is derived, else None. Per thread: another thread's launches never enter it."""

    planner: list | None = None


_planning = _Planning()


def cached_launch(fn: Any) -> CachedLaunch:
    """Wrap a ``@triton.jit`` function: ``wrapped[grid](*args, **constexprs)``."""
    return CachedLaunch(fn)


class CachedLaunch:
    """A ``@triton.jit`` function with a cache of its compiled kernels by
    specialisation; indexing by a grid gives the launch callable, as Triton's does."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._interpreted = interpreting()
        self._compiled: dict[tuple, Any] = {}
        if self._interpreted:  # the interpreter's function has no Triton parameters
            params = inspect.signature(fn.fn).parameters.values()
            self._params = [(p.name, None if p.default is p.empty else p.default) for p in params]
        else:
            self._params = [(p.name, p.default) for p in fn.params]

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if self._interpreted and _planning.planner is None:
            return lambda *args, **kwargs: self._interpret(grid, args, kwargs)
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _interpret(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        with _interpreter:
            return self.fn[grid](*args, **kwargs)

    def launch(
        self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any], rest: tuple = ()
    ) -> None:
        """Launch on ``grid`` (1 to 3 dims) on the current device's current stream.
        ``rest``: :meth:`rest_key` of ``args[1:]`` and ``kwargs``, where the caller keeps
        it for arguments that do not change between its launches (only the first
        argument's specialisation is then computed)."""
        planner = _planning.planner
        if planner is not None:  # compiled, not launched
            kernel = self._compiled_for(grid, args, kwargs)
            planner.append((kernel, grid, (*args, *self._trailing(len(args), kwargs))))
            return
        if self._interpreted:
            self._interpret(grid, args, kwargs)
            return
        device = _current_device()
        if rest:
            key = (device, *specialisation(args[:1]), *rest)
        else:
            key = (device, *specialisation(args), *kwargs.items())
        compiled = self._compiled.get(key)
        if compiled is None or not _direct:
            kernel = self.fn[grid](*args, **kwargs)
            if kernel is not None:  # its launcher and what it takes besides the arguments
                trailing = self._trailing(len(args), kwargs)
                self._compiled[key] = (kernel, kernel.run, kernel.function, trailing)
            return
        kernel, run, function, trailing = compiled
        values = (*args, *trailing)
        stream = _current_stream(device)
        g = (*grid, 1, 1)
        # Triton's launch hooks (set by profilers) see the launch as they would from
        # Triton's own path; an empty chain of them (Triton >= 3.5 always has one) is
        # passed as None, which spares building launch metadata nobody reads.
        enter, leave = _hook(_runtime.launch_enter_hook), _hook(_runtime.launch_exit_hook)
        metadata = None
        if enter is not None or leave is not None:
            metadata = kernel.launch_metadata(grid, stream, *values)
        try:
            run(g[0], g[1], g[2], stream, function, kernel.packed_metadata, metadata, enter,
                leave, *values)  # fmt: skip
        except TypeError as e:  # another Triton's launcher signature: use Triton's path
            _switch_off(e)
            self.fn[grid](*args, **kwargs)

    @staticmethod
    def rest_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
        """What :meth:`launch`'s key holds for ``args`` (all but the first argument) and
        ``kwargs``: kept by a caller whose later launches pass the same ones."""
        return (*specialisation(args), *kwargs.items())

    def _compiled_for(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        """The compiled kernel Triton would launch for these arguments, from the cache of
        direct launches where a launch of the same specialisation filled it, else from
        Triton's warm-up (which fills it)."""
        if self._interpreted:
            return warmup(self.fn, grid, args, kwargs)
        key = (_current_device(), *specialisation(args), *kwargs.items())
        compiled = self._compiled.get(key)
        if compiled is None:
            kernel = warmup(self.fn, grid, args, kwargs)
            if kernel is None:  # compiling in the background
                return None
            trailing = self._trailing(len(args), kwargs)
            compiled = self._compiled[key] = (kernel, kernel.run, kernel.function, trailing)
        return compiled[0]

    def _trailing(self, positional: int, kwargs: dict[str, Any]) -> tuple:
        """The values of the parameters after the positional ones, in the kernel's
        order, defaults filled in (Triton's launcher takes every parameter, constexprs
        included); launch options such as ``num_warps`` are not parameters. They are
        part of the cache key, so they are the same for every hit."""
        return tuple(kwargs.get(name, default) for name, default in self._params[positional:])


def plan_launches(planner: list | None) -> None:
    """From now on, compile this thread's launches without launching them and append
    each to ``planner`` as (Triton's compiled kernel, grid, every parameter's value in
    order); None: launch again. Other threads' launches are untouched."""
    _planning.planner = planner


def planning() -> bool:
    """Whether this thread's launches are being planned (a launcher then prefers our
    kernels to PyTorch's ops, which a plan cannot hold)."""
    return _planning.planner is not None


def warmup(fn: Any, grid: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The compiled kernel Triton would launch for these arguments, compiled if it was
    not (Triton's warm-up API: nothing is launched)."""
    return fn.warmup(*args, grid=grid, **kwargs)


def specialisation(args: tuple) -> list:
    """What Triton's choice of a compiled kernel may depend on, per argument (a superset
    of its specialisation): a tensor's dtype and 16-byte alignment; an int's being 1,
    dividing by 16, and its width class (32-bit, 64-bit, unsigned 64-bit); a float's
    type only; anything else (None, bools, constexpr values) itself. One comprehension,
    no call per argument: it runs on every launch."""
    return [
        (a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
        else (a == 1, not a & 15, _I32[0] <= a < _I32[1], a < _I64) if a.__class__ is int
        else float if a.__class__ is float
        else a
        for a in args
    ]  # fmt: skip


def _hook(chain: Any) -> Any:
    """A launch hook, or None for none: an empty HookChain (Triton >= 3.5) is none."""
    return chain if getattr(chain, "calls", True) else None


_runtime = knobs.runtime
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _switch_off(error: Exception) -> None:
    global _direct
    _direct = False
    _log.warning("direct Triton launches switched off (%s); Triton's own launch path runs", error)

"""Whether a plain training loop waits on its host, told once (``graph_layers`` off).

A small model's layers can take the GPU less time than the host takes to queue them
(Gemma3-1B's LoRA step on an H200: 135-190 ms against 95 ms of kernels). The loop then
runs at the host's pace, and the policy's ``graph_layers`` (each layer replayed from
CUDA graphs) is what takes that host time out. Nothing in a plain loop's step times
says so. :class:`HostWaits` watches a model's decoder layers in training steps
:data:`WATCHED` (the first ones warm caches up). At each layer's forward and at each
layer's backward (a hook on its output's gradient), it records a CUDA event and asks
whether the event recorded at the previous of these points has run. Where the GPU is
ahead of the host, that event is done when the host gets to the next point: the GPU had
nothing left to run. Where it is behind, the queue holds the event for several layers
more. The verdict reads the backward's points only. Where the GPU sets the step, the
forward's queue can stay shallow too: on an H200, Llama-3.2-1B's LoRA forward ran under
1 ms behind its host, its backward 9-24 ms, and graphed layers gained nothing there.
Where at least :data:`SHARE` of the backward's points find the GPU caught up, one
``UserWarning`` names ``graph_layers``. The test errs toward silence: Gemma3-1B found 38
of 52 on one host and was told; on a slower host it found 17, its forward's GPU idle
throughout. On the next step's first layer the watch gives the layers back their
forwards, and costs nothing more. The ``xpuruntime.pytorch.graphs`` log gives the counts
either way.

The watch ends without a word where a verdict would mislead: gradient checkpointing (the
backward runs each forward again), ``torch.distributed`` initialised (``graph_layers``
does not graph there), a CUDA-graph capture or its warm-up (``make_train_step``'s graphed
step: no host to take out), or a model moved off CUDA. Under ``torch.compile`` it
measures nothing.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .layers import NOT_TRAINING, unwrapped, why_eager

__all__ = ["SHARE", "WATCHED", "HostWaits", "WatchedLayer"]

WATCHED = (3, 4)
"""The training steps watched (counted from 1 by the first layer's calls)."""

SHARE = 0.5
"""The share of the backward's points that must find the GPU caught up for the
warning."""

_log = logging.getLogger("xpuruntime.pytorch.graphs")


class HostWaits:
    """The watch over one model's decoder layers: each layer's forward becomes a
    :class:`WatchedLayer` until the watch ends.

    Parameters
    ----------
    layers : list of (str, nn.Module)
        The decoder layers, in the order the forward runs them.
    """

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self._lock = threading.Lock()
        self._step = 0
        self._points = [0, 0]  # (forward, backward)
        self._caught_up = [0, 0]
        self._last: torch.cuda.Event | None = None
        self._layers: list[tuple[nn.Module, Any, WatchedLayer]] = []
        for i, (_, module) in enumerate(layers):
            written = module.__dict__.get("forward")
            watched = WatchedLayer(module, module.forward, self, first=i == 0)
            module.forward = watched
            self._layers.append((module, written, watched))

    @property
    def watching(self) -> bool:
        """Whether the layers' forwards are still watched."""
        return bool(self._layers)

    @property
    def caught_up(self) -> tuple[int, int]:
        """(backward points that found the GPU caught up, backward points) in the steps
        watched so far."""
        return self._caught_up[1], self._points[1]

    def end(self) -> None:
        """Give the layers back their forwards (the watch says nothing more)."""
        layers, self._layers = self._layers, []
        for module, written, watched in layers:
            if module.__dict__.get("forward") is not watched:
                continue  # (replaced since: left as it is)
            if written is None:
                del module.forward
            else:
                module.forward = written

    # -- the layers' calls ---------------------------------------------------------------
    def _before(self, module: nn.Module, first: bool) -> bool:
        """Whether this call of a layer is measured (its backward too)."""
        if self._stopped(module):
            return False
        if first:
            self._step += 1
            if self._step > WATCHED[-1]:
                self._tell()
                self.end()
                return False
            self._last = None  # (between steps the loop's own work runs: not a layer's)
        if self._step not in WATCHED:
            return False
        self._point(0)
        return True

    def _after(self, output: Any) -> None:
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(first, Tensor) and first.requires_grad:
            first.register_hook(self._at_backward)

    def _at_backward(self, grad: Tensor) -> None:
        if self.watching and not _capturing():
            self._point(1)

    # -- the measure -----------------------------------------------------------------------
    def _stopped(self, module: nn.Module) -> bool:
        """Whether this call is not measured: outside training, or (ending the watch)
        where a verdict would mislead."""
        if torch.compiler.is_compiling():
            return True
        why = why_eager(module)
        if why is None and not _on_cuda(module):
            why = "moved off CUDA"
        if why is None:
            return False
        if why != NOT_TRAINING or _capturing():
            self.end()
        return True

    def _point(self, phase: int) -> None:
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            last, self._last = self._last, event
            if last is not None:
                self._points[phase] += 1
                self._caught_up[phase] += last.query()

    def _tell(self) -> None:
        (forward, caught_up), (forwards, points) = self._caught_up, self._points
        _log.info("host waits: in steps %d-%d the GPU had caught up with the host at %d of "
                  "%d layers' backward (at %d of %d forward)", WATCHED[0], WATCHED[-1],
                  caught_up, points, forward, forwards)  # fmt: skip
        if not points or caught_up < SHARE * points:
            return
        warnings.warn(
            f"optimize: this training loop's backward waits on its host. At {caught_up} of "
            f"{points} layers' backward in steps {WATCHED[0]}-{WATCHED[-1]}, the GPU had "
            "run everything queued before the layer before. The policy's graph_layers "
            "(optimize(model, {'graph_layers': True})) replays each decoder layer from "
            "CUDA graphs; make_train_step(..., cuda_graph=True) graphs the whole step.",
            UserWarning,
            stacklevel=2,
        )


class WatchedLayer:
    """A decoder layer's forward under a :class:`HostWaits` watch: the layer's own, with
    a point of the watch before it and one at its backward.

    Parameters
    ----------
    module : nn.Module
        The layer.
    forward : callable
        Its forward as it stands.
    watch : HostWaits
        The model's watch.
    first : bool
        Whether it is the model's first decoder layer (its calls count the steps).
    """

    def __init__(
        self, module: nn.Module, forward: Callable[..., Any], watch: HostWaits, first: bool
    ) -> None:
        self._module = weakref.ref(module)  # (the module holds this as its forward)
        self._forward = forward
        self._watch = watch
        self._first = first

    def __reduce__(self) -> tuple:
        # A pickled model keeps the forward as written, unwatched.
        return (unwrapped, (self._forward,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None or not self._watch._before(module, self._first):
            return self._forward(*args, **kwargs)
        output = self._forward(*args, **kwargs)
        self._watch._after(output)
        return output


def _on_cuda(module: nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and first.is_cuda


def _capturing() -> bool:
    from .capture import warming_up

    if warming_up():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

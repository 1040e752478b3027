"""Activation offload for checkpointed layers: each layer's input waits in pinned host
memory between its forward and its backward, instead of on the GPU.

Gradient checkpointing keeps one tensor per layer, its input, and recomputes the rest in
the backward; at long context those inputs are what is left of the activations (the
Llama-3.2-1B shape at B4 x T2048: 16 of 32 MiB each in bf16). Here the forward copies
the input to pinned host memory on a side stream, as soon as the layer has it; the
backward of layer ``i`` starts the copy back of layer ``i - 1``'s input on that stream, so
that it arrives while layer ``i`` recomputes and differentiates. PyTorch's pinned-memory
allocator caches its blocks, and keeps one from reuse until the copies that read it
are done.

The layer runs as one autograd node, as reentrant checkpointing does: its forward
without gradients, its backward a recompute with them, under the forward's autocast
state and random-number state (dropout draws the same masks), the parameters' gradients
accumulated by an inner backward. Unlike reentrant checkpointing it needs no input that
requires a gradient (a LoRA model's frozen embeddings give none): a placeholder that does
keeps the node in the graph.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._ops._infra._first_order import first_order

__all__ = ["ActivationOffload"]


class ActivationOffload:
    """The offload of one model's checkpointed layers: where transformers calls its
    ``_gradient_checkpointing_func(function, *args)``, call this object instead.

    Parameters
    ----------
    prefetch : bool
        Start bringing back the previous layer's input as each layer's backward starts
        (True), or only when that layer's backward needs it.
    """

    def __init__(self, prefetch: bool = True) -> None:
        self.prefetch = prefetch
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref[_Held]] = []  # in forward order, not yet brought back
        self._placeholder: torch.Tensor | None = None

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        if self._placeholder is None:
            self._placeholder = torch.empty(0, requires_grad=True)
        return _Offloaded.apply(function, self, self._placeholder, *args)

    def __reduce__(self) -> tuple:
        return (type(self), (self.prefetch,))  # streams and held inputs are the process's

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream the copies of ``device``'s tensors run on."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def hold(self, tensor: torch.Tensor) -> _Held:
        """Start the copy of ``tensor`` to pinned host memory (on a CUDA device: on the
        side stream, after the work that made it)."""
        held = _Held(self, tensor)
        self._order = [ref for ref in self._order if ref() is not None]
        self._order.append(weakref.ref(held))
        return held

    def bring_back(self, held: _Held) -> torch.Tensor:
        """``held``'s tensor on its device again, once the copy is done (on the current
        stream); the one held before it starts coming back."""
        tensor = held.fetch()
        live = [ref() for ref in self._order]
        at = next((i for i, h in enumerate(live) if h is held), None)
        if at is not None:
            del self._order[at]
            if self.prefetch and at > 0 and live[at - 1] is not None:
                live[at - 1].fetch_ahead()
        return held.arrived(tensor)


class _Held:
    """One tensor waiting in pinned host memory (or, off CUDA, in a host copy)."""

    def __init__(self, offload: ActivationOffload, tensor: torch.Tensor) -> None:
        self._offload = offload
        self.device, self.requires_grad = tensor.device, tensor.requires_grad
        if tensor.device.type != "cuda":
            self.host = tensor.detach().clone()
        else:
            stream = offload.stream(tensor.device)
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):  # the copy back follows on this stream
                self.host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(stream)  # not reused before the copy has read it
        self._back: torch.Tensor | None = None
        self._arrived: torch.cuda.Event | None = None

    def fetch_ahead(self) -> None:
        """Start the copy back to the device (on the side stream), if not started."""
        if self._back is not None or self.device.type != "cuda":
            return
        stream = self._offload.stream(self.device)
        back = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # ``back``'s memory
        with torch.cuda.stream(stream):
            back.copy_(self.host, non_blocking=True)
            self._arrived = torch.cuda.Event()
            self._arrived.record(stream)
        self._back = back

    def fetch(self) -> torch.Tensor:
        """The tensor on its device; the current stream waits for its copy."""
        if self.device.type != "cuda":
            return self.host
        self.fetch_ahead()
        torch.cuda.current_stream(self.device).wait_event(self._arrived)
        return self._back

    def arrived(self, tensor: torch.Tensor) -> torch.Tensor:
        self._back, self.host = None, None  # the host block goes back to the allocator
        return tensor.detach().requires_grad_(self.requires_grad)


class _Offloaded(torch.autograd.Function):
    """``function(*args)`` as one node whose tensor arguments wait on the host."""

    @staticmethod
    def forward(ctx, function, offload, placeholder, *args):
        ctx.function, ctx.offload = function, offload
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        ctx.device_type = "cpu" if device is None else device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.rng = _rng_state(device)
        ctx.args = [offload.hold(a) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.no_grad():
            return function(*args)

    @staticmethod
    @first_order("offload_activations")
    def backward(ctx, *grads):
        args = [ctx.offload.bring_back(a) if isinstance(a, _Held) else a for a in ctx.args]
        ctx.args = None
        with torch.enable_grad(), _autocast(ctx.device_type, ctx.autocast), _rng(ctx.rng):
            outputs = ctx.function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = [a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None
                  for a in args]  # fmt: skip
        return (None, None, None, *inputs)


def _autocast_state(device_type: str) -> dict[str, Any]:
    state = {"device": _one_autocast(device_type)}
    if device_type != "cpu":
        state["cpu"] = _one_autocast("cpu")
    return state


def _one_autocast(device_type: str) -> tuple[bool, torch.dtype, bool]:
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


def _autocast(device_type: str, state: dict[str, Any]) -> contextlib.ExitStack:
    """The forward's autocast state, for its recompute."""
    stack = contextlib.ExitStack()
    for key, (enabled, dtype, cache) in state.items():
        kind = device_type if key == "device" else "cpu"
        stack.enter_context(torch.autocast(kind, dtype, enabled=enabled, cache_enabled=cache))
    return stack


def _rng_state(device: torch.device | None) -> tuple:
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = (device, torch.cuda.get_rng_state(device))
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng(state: tuple):
    """The forward's random-number state for its recompute (the caller's is restored
    after, as torch.utils.checkpoint does)."""
    cpu, cuda = state
    devices = [] if cuda is None else [cuda[0]]
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        yield

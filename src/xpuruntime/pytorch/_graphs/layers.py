"""CUDA graphs per layer, for training loops that cannot be graphed whole (the policy's
``graph_layers``).

A plain loop (``loss = model(**batch).loss; loss.backward(); optimizer.step()``, or
Hugging Face's ``Trainer``) launches every kernel from Python. On a small model the host
then takes longer than the GPU (Gemma3-1B's LoRA step on an H200: 140-170 ms of host
work over 95 ms of kernels). :class:`GraphedLayer` replaces a decoder layer's forward.
At its first training call of each input signature it warms the layer up (three runs,
the last rehearsing the capture's paths: :mod:`.._ops._infra._capture_paths`). It then
captures the layer's forward and its backward (``torch.autograd.grad`` over the layer's
inputs and trained parameters) as two CUDA graphs. From then on each call copies its
inputs in and replays them, as an autograd function. The loop's own code (data, loss,
optimizer, logging) stays as it is.

A signature is the call's structure and non-tensor arguments, and each tensor's shape,
strides, dtype, device and ``requires_grad``. Autocast's state counts too, and the
layer's parameters and buffers (which train, and where they live). A new signature is
captured anew, up to :data:`SIGNATURES` a layer. Past that, and wherever a graph cannot
hold the call, the layer runs its own forward. The ``xpuruntime.pytorch.graphs`` log
says why, once a layer and reason:

- not training, gradients off, under ``torch.compile`` or inside another capture (a
  graphed step), gradient checkpointing on, ``torch.distributed`` initialised;
- an argument other than a CUDA tensor, None, a number, a string or a flag (a KV cache);
- a forward whose backward has not run yet (a second forward before the backward: its
  replay would overwrite the saved activations the first still needs);
- an op a graph cannot capture (a host read), named; a capture the driver fails, with
  the last op captured (PyTorch's CUDA generator is then taken out of capture mode).

Memory: each layer's graphs keep what its backward reads (as the plain loop does between
forward and backward) for as long as they live, plus the layer's static inputs and
outputs. Layers of one signature share one pool, captured in the order they run, so a
layer's scratch memory is shared with the others'.

A layer's output is its graph's static output: the layer's next graphed call rewrites
it. The gradients handed back (the layer input's, the parameters') are fresh tensors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..._errors import CudaError, InvalidInputError, UnsupportedOperationError
from .._functional._documents import DocumentMask, causal_within
from .._ops._infra._first_order import first_order
from .capture import CapturedGraph, StaticInputs, warm_up, warming_up

__all__ = ["NOT_TRAINING", "SIGNATURES", "GraphedLayer", "LayerGraphs", "unwrapped", "why_eager"]

SIGNATURES = 4
"""How many input signatures one layer captures graphs for (each keeps its own memory)."""

_log = logging.getLogger("xpuruntime.pytorch.graphs")
_PLAIN = (type(None), bool, int, float, str)


class LayerGraphs:
    """What the graphed layers of one model share: a memory pool per signature, a lock
    around captures and replays, and the reasons already logged."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._pools: dict[Any, Any] = {}
        self._logged: set[tuple[str, str]] = set()

    def pool(self, signature: Any) -> Any:
        """The pool of the graphs of ``signature`` (None before its first capture)."""
        return self._pools.get(signature)

    def keep_pool(self, signature: Any, pool: Any) -> None:
        self._pools.setdefault(signature, pool)

    def ran_eagerly(self, path: str, why: str) -> None:
        """Log, once per layer and reason, that a call ran the layer's own forward."""
        if (path, why) not in self._logged:
            self._logged.add((path, why))
            _log.warning("graph_layers: %s ran its own forward: %s", path, why)


class GraphedLayer:
    """A layer's forward, replayed from CUDA graphs where a training call allows.

    Parameters
    ----------
    module : nn.Module
        The layer.
    forward : callable
        Its forward as it stands (a rewritten one, where ``optimize`` rewrote it).
    path : str
        Its name in the model, for the log.
    shared : LayerGraphs
        What the model's graphed layers share.
    """

    def __init__(
        self, module: nn.Module, forward: Callable[..., Any], path: str, shared: LayerGraphs
    ) -> None:
        self._module = weakref.ref(module)  # (the module holds this as its forward)
        self._forward = forward
        self._path = path
        self._shared = shared
        self._graphs: dict[Any, _LayerGraph | None] = {}  # None: refused, runs eagerly

    def __reduce__(self) -> tuple:
        # Graphs, pools and locks are the process's: a pickled model keeps the forward
        # as written (optimize graphs the loaded model's layers again).
        return (unwrapped, (self._forward,))

    @property
    def signatures(self) -> int:
        """How many input signatures have graphs."""
        return sum(graph is not None for graph in self._graphs.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        why = why_eager(module)
        if why is not None:
            if why != NOT_TRAINING:
                self._shared.ran_eagerly(self._path, why)
            return self._forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors, others, masks = [], [], {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                if leaf.device.type != "cuda":
                    self._shared.ran_eagerly(self._path, f"a tensor argument on {leaf.device}")
                    return self._forward(*args, **kwargs)
                if isinstance(leaf, DocumentMask):  # (its documents are what it holds)
                    masks[i] = leaf.window
                    leaf = leaves[i] = leaf.documents
                elif type(leaf) not in (Tensor, nn.Parameter):
                    self._shared.ran_eagerly(
                        self._path, f"a tensor argument of type {type(leaf).__name__}"
                    )
                    return self._forward(*args, **kwargs)
                tensors.append(leaf)
            elif isinstance(leaf, _PLAIN):
                others.append(leaf)
            else:
                self._shared.ran_eagerly(
                    self._path, f"an argument of type {type(leaf).__name__} (a graph keeps "
                    "the values it was captured with)",
                )  # fmt: skip
                return self._forward(*args, **kwargs)
        state = [*module.parameters(), *module.buffers()]
        signature = (
            spec,
            tuple(others),
            tuple(masks.items()),
            tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors),
            _autocast_state(),
        )
        key = (signature, tuple((t.data_ptr(), t.requires_grad) for t in state))
        params = [p for p in state if p.requires_grad and isinstance(p, nn.Parameter)]
        if not params and not any(t.requires_grad for t in tensors):
            return self._forward(*args, **kwargs)  # (nothing trains through it)
        with self._shared.lock:
            graph = self._graphs.get(key, False)
            if graph is False:
                graph = self._capture(module, key, signature, leaves, spec, masks, params)
            if graph is None:
                return self._forward(*args, **kwargs)
            if graph.pending:
                self._shared.ran_eagerly(
                    self._path, "its graph's last forward still waits for its backward (a "
                    "replay would overwrite the activations that backward reads)",
                )  # fmt: skip
                return self._forward(*args, **kwargs)
            outputs = _Replay.apply(graph, *tensors, *params)
        return pytree.tree_unflatten(_placed(graph.output_leaves, outputs), graph.output_spec)

    def _capture(self, module, key, signature, leaves, spec, masks, params) -> _LayerGraph | None:
        if self.signatures >= SIGNATURES:
            self._graphs[key] = None
            self._shared.ran_eagerly(
                self._path, f"more than {SIGNATURES} input signatures (shapes, dtypes or "
                "arguments); each keeps graphs and memory of its own",
            )  # fmt: skip
            return None
        device = next((t.device for t in leaves if isinstance(t, Tensor)), params[0].device)
        try:
            with torch.cuda.device(device):  # (a model spread over GPUs: the layer's)
                graph = _LayerGraph(self._forward, module, leaves, spec, masks, params,
                                    self._shared.pool(signature), self._path)  # fmt: skip
        except (UnsupportedOperationError, CudaError) as e:
            self._graphs[key] = None
            if isinstance(e, CudaError):
                _end_generator_capture(device)
            self._shared.ran_eagerly(self._path, f"not captured: {e}")
            return None
        self._shared.keep_pool(signature, graph.pool)
        self._graphs[key] = graph
        _log.info("graph_layers: %s captured for inputs %s", self._path, graph.described)
        return graph


NOT_TRAINING = "not training"


def unwrapped(forward: Callable[..., Any]) -> Callable[..., Any]:
    """What a pickled graphed (or watched) layer's forward loads as: the one it wraps."""
    return forward


def why_eager(module: nn.Module | None) -> str | None:
    """Why a call runs the layer's own forward, whatever its arguments (None: it may
    replay)."""
    if module is None or not module.training or not torch.is_grad_enabled():
        return NOT_TRAINING
    if torch.compiler.is_compiling():
        return "under torch.compile"
    if warming_up() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return NOT_TRAINING  # (a graphed step captures the layer whole, as written)
    if getattr(module, "gradient_checkpointing", False) is True:
        return "gradient checkpointing is on (its backward runs the forward again)"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return ("torch.distributed is initialised (DDP and FSDP hook each gradient; "
                "make_train_step(cuda_graph=True) graphs their steps)")  # fmt: skip
    return None


def _end_generator_capture(device: torch.device) -> None:
    """Take the CUDA generator out of capture mode after a capture the driver failed.

    PyTorch ends a generator's capture only when the driver ends the capture cleanly;
    after a failed one, every later random op raises "Offset increment outside graph
    capture". A capture that ends cleanly ends it.
    """
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph):
            torch.empty(1, device=device).zero_()
    finally:
        graph.reset()


def _autocast_state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


def _placed(leaves: list[Any], outputs: tuple[Tensor, ...]) -> list[Any]:
    """The output leaves with each tensor (None in ``leaves``) taken from ``outputs``."""
    replayed = iter(outputs)
    return [next(replayed) if leaf is None else leaf for leaf in leaves]


class _LayerGraph:
    """One layer's forward and backward graphs for one input signature."""

    def __init__(self, forward, module: nn.Module, leaves, spec, masks: dict[int, int | None],
                 params: list[Tensor], pool, path: str) -> None:  # fmt: skip
        what = f"graph_layers ({path})"
        self.inputs = StaticInputs.of(pytree.tree_unflatten(leaves, spec), what)
        static = pytree.tree_leaves(self.inputs.tree)
        self.described = self.inputs.describe()
        places = _Places(module, params)

        def run() -> tuple[Any, list[Tensor]]:
            """The layer's outputs over the static inputs, and the leaves its gradients
            are taken for: the trained inputs and parameters, each a fresh leaf over the
            same storage (:meth:`_Places.fresh`)."""
            given = [_fresh(t) for t in static]
            # A document mask made anew from the static documents each run: its bounds
            # are computed inside the graph, from the documents of the replay.
            for i, window in masks.items():
                documents = given[i]
                given[i] = DocumentMask(
                    documents, functools.partial(causal_within, documents, window), window
                )
            args, kwargs = pytree.tree_unflatten(given, spec)
            with places.fresh() as fresh:
                outputs = forward(*args, **kwargs)
            trained = [t for t in given if isinstance(t, Tensor) and t.requires_grad]
            return outputs, trained + fresh

        def once() -> None:
            outputs, wanted = run()
            out = [t for t in _tensor_leaves(outputs) if t.requires_grad]
            grads = torch.autograd.grad(
                out, wanted, [torch.ones_like(t) for t in out], allow_unused=True
            )
            trained = grads[len(grads) - len(params) :]
            unread = [name for name, g in zip(places.names, trained) if g is None]
            if unread:
                raise UnsupportedOperationError(
                    f"no gradient reaches {', '.join(unread)} through the layer's module "
                    "(a trained parameter unused, or read through a reference of its own)"
                )

        with _autocast_uncached():
            # A first call, the checked run, then the capture rehearsed.
            warm_up(once, 3, True, rehearse=True)
            self._forward = CapturedGraph(pool)
            # (checked: a failure names the last op captured)
            with self._forward._capturing(None, True):
                outputs, wanted = run()
            leaves, self.output_spec = pytree.tree_flatten(outputs)
            self.outputs = [t for t in leaves if isinstance(t, Tensor)]
            self.output_leaves = [None if isinstance(t, Tensor) else t for t in leaves]
            differentiable = [t for t in self.outputs if t.requires_grad]
            self._differentiable = [t.requires_grad for t in self.outputs]
            self._grad_outputs = [torch.empty_like(t) for t in differentiable]
            self._backward = CapturedGraph(self._forward.pool)
            try:
                with self._backward._capturing(None, True):
                    grads = torch.autograd.grad(differentiable, wanted, self._grad_outputs,
                                                retain_graph=True, allow_unused=True)  # fmt: skip
            except CudaError as e:
                raise CudaError(f"its backward: {e}") from e
        # The capture's autograd graph is kept: its saved tensors are the memory the
        # backward graph reads, which the pool must never hand to a later capture.
        self._kept = outputs
        wants = [t.requires_grad for t in self.inputs.tensors]
        grads = list(grads)
        self._input_grads = [grads.pop(0) if w else None for w in wants]
        self._param_grads = grads
        self.pool = self._forward.pool
        self.pending = False
        self.generation = 0

    def replay(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        for buffer, tensor in zip(self.inputs.tensors, tensors):
            if tensor.data_ptr() != buffer.data_ptr():
                buffer.copy_(tensor)
        with torch.cuda.device(self.inputs.device):
            self._forward.replay()
        self.generation += 1
        self.pending = True
        return tuple(t.detach() for t in self.outputs)

    def replay_backward(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        given = (g for g, d in zip(grads, self._differentiable) if d)
        for buffer, grad in zip(self._grad_outputs, given):
            if grad is None:
                buffer.zero_()
            else:
                buffer.copy_(grad)
        with torch.cuda.device(self.inputs.device):
            self._backward.replay()
        self.pending = False
        fresh = lambda g: None if g is None else g.clone()  # noqa: E731
        return tuple(map(fresh, self._input_grads)) + tuple(map(fresh, self._param_grads))


class _Places:
    """Where a layer's trained parameters sit: each (module, attribute) that holds one,
    a tied parameter's every place."""

    def __init__(self, module: nn.Module, params: list[Tensor]) -> None:
        names = {id(p): name for name, p in module.named_parameters()}
        self.params = params
        self.names = [names[id(p)] for p in params]
        trained = {id(p) for p in params}
        self._slots = [
            (owner, attribute, p)
            for owner in module.modules()
            for attribute, p in owner._parameters.items()
            if p is not None and id(p) in trained
        ]

    @contextlib.contextmanager
    def fresh(self) -> Iterator[list[nn.Parameter]]:
        """Within the block, each trained parameter is a new leaf over its storage (the
        leaves, in the order of ``params``). Autograd keeps the stream a gradient
        accumulator was made on: the parameters' own, made on the caller's stream, would
        make a captured backward wait outside the capture."""
        leaves = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in self.params}
        for owner, attribute, p in self._slots:
            owner._parameters[attribute] = leaves[id(p)]
        try:
            yield [leaves[id(p)] for p in self.params]
        finally:
            for owner, attribute, p in self._slots:
                owner._parameters[attribute] = p


def _fresh(leaf: Any) -> Any:
    """A tensor that trains as a new leaf over the same storage; anything else as is."""
    if isinstance(leaf, Tensor) and leaf.requires_grad:
        return leaf.detach().requires_grad_()
    return leaf


class _Replay(torch.autograd.Function):
    """A layer's graphs as one autograd node: the forward replay, then the backward's."""

    @staticmethod
    def forward(ctx, graph: _LayerGraph, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.graph, ctx.generation = graph, graph.generation + 1
        # Released when autograd drops the node unrun (a forward whose loss is discarded).
        ctx.token = _Token()
        weakref.finalize(ctx.token, _release, weakref.ref(graph), ctx.generation)
        outputs = graph.replay(tensors[: len(graph.inputs.tensors)])
        for t, differentiable in zip(outputs, graph._differentiable):
            if not differentiable:
                ctx.mark_non_differentiable(t)
        return outputs

    @staticmethod
    @first_order("graph_layers (a layer's captured backward)")
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        graph = ctx.graph
        if graph.generation != ctx.generation:
            raise InvalidInputError(
                "graph_layers: a layer's graph replayed another forward before this "
                "backward ran (a backward with retain_graph=True, run again after a later "
                "forward): the activations it reads are gone. Run each backward before "
                "the next forward, or leave graph_layers off"
            )
        return (None, *graph.replay_backward(grads))


class _Token:
    """Lives as long as a replay's autograd node."""


def _release(graph_ref: weakref.ref, generation: int) -> None:
    graph = graph_ref()
    if graph is not None and graph.generation == generation:
        graph.pending = False


def _tensor_leaves(tree: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]


def _autocast_uncached():
    """Autocast as it is, with its cast cache off (a cast cached during a capture would
    hold memory the graph only fills when it replays)."""
    if not torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", enabled=False)
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)

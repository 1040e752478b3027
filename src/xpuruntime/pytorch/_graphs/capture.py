"""CUDA graphs for PyTorch work: capture once, replay many times, without launch cost.

Two entries, and the training step built on them:

- :func:`capture_graph`: a context manager; what runs in the block is captured into a
  :class:`CapturedGraph` (the caller warms up and keeps the static tensors). Given a
  function instead, it graphs the function as :class:`CUDAGraphWrapper` does.
- :class:`CUDAGraphWrapper`: ``capture(fn, *args, **kwargs)`` warms ``fn`` up on a side
  stream, captures it with static copies of its tensor arguments, and ``replay(*args)``
  copies new arguments in and returns the static outputs.
- :func:`~.._training._train_step.make_graphed_train_step` (in
  :mod:`.._training._train_step`): a whole training step captured as one graph, built on
  these.

What capture forbids is checked op by op, by a dispatch mode that exists only for one
run (so replays cost nothing): the first warm-up run where there is a warm-up (under
Dynamo's ``force_eager`` stance, so that torch.compile'd code is checked uncompiled and
still compiles afterwards), the capture itself otherwise. An op that reads a value back
to the host (``tensor.item()``, ``bool(tensor)``, ``nonzero``) or works on CPU tensors
raises :class:`~xpuruntime.UnsupportedOperationError` naming the op and the line that
called it, before it can invalidate the capture. A CUDA error during capture names the
last op that ran.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..._errors import CudaError, InvalidInputError, UnsupportedOperationError
from .._ops._infra._capture_paths import rehearsal
from .._selection._policy import by_gpu_time
from .._selection._ranges import annotate

__all__ = ["CUDAGraphWrapper", "CapturedGraph", "GraphCapture", "capture_graph", "require_cuda",
           "StaticInputs", "describe", "run_checked", "warm_up", "warming_up"]  # fmt: skip

_log = logging.getLogger("xpuruntime.pytorch.graphs")
aten = torch.ops.aten

# Ops that wait for the device and read a value back: forbidden while capturing.
_HOST_READS = {
    "_local_scalar_dense": "reads a value back to the host (tensor.item(), bool(tensor), "
    "float(tensor), printing a tensor)",
    "is_nonzero": "reads a value back to the host (bool(tensor), `if tensor:`)",
    "equal": "reads its answer back to the host (torch.equal)",
    "nonzero": "has an output shape that depends on the data (a host sync)",
    "masked_select": "has an output shape that depends on the data (a host sync)",
    "unique": "has an output shape that depends on the data (a host sync)",
    "_unique2": "has an output shape that depends on the data (a host sync)",
    "unique_consecutive": "has an output shape that depends on the data (a host sync)",
    "unique_dim": "has an output shape that depends on the data (a host sync)",
}


class _CaptureChecker(TorchDispatchMode):
    """Refuses, by name, the ops a CUDA graph cannot hold; remembers the last op."""

    def __init__(self) -> None:
        super().__init__()
        self.last_op: str | None = None
        self.refused: UnsupportedOperationError | None = None  # kept: a C++ caller may lose it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.last_op = f"aten.{name}" if func.namespace == "aten" else str(func)
        why = _HOST_READS.get(name)
        if why is not None:
            self.refused = UnsupportedOperationError(
                f"{self.last_op}{_called_at()} {why}: a CUDA graph cannot capture it. Keep "
                "it out of the captured region, or use a device-side equivalent"
            )
            raise self.refused
        cpu = _cpu_operand(func, args, kwargs)
        if cpu is not None:
            self.refused = UnsupportedOperationError(
                f"{self.last_op}{_called_at()} works on a CPU tensor of shape "
                f"{tuple(cpu.shape)}: a CUDA graph replays only GPU work, so its result "
                "would stay frozen at capture. Move the tensor to the GPU before capturing"
            )
            raise self.refused
        return func(*args, **kwargs)


def _called_at() -> str:
    """`` (called at FILE:LINE, in FUNCTION)``: the innermost frame outside torch and
    this module, a library's line or the user's (empty where none is)."""
    ignored = (os.path.dirname(torch.__file__) + os.sep, __file__)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(ignored):
            where = frame.filename.rpartition("site-packages" + os.sep)[2]
            return f" (called at {where}:{frame.lineno}, in {frame.name})"
    return ""


def _cpu_operand(func, args, kwargs) -> torch.Tensor | None:
    """A CPU tensor (not a 0-dim scalar) the op reads, unless it is a copy from pinned
    memory, which a graph replays from the same host buffer."""
    flat = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    cpu = [t for t in flat if t.device.type == "cpu" and t.dim() > 0]
    if not cpu:
        return None
    if func in (aten.copy_.default, aten._to_copy.default) and all(t.is_pinned() for t in cpu):
        return None
    return cpu[0]


class CapturedGraph:
    """A captured CUDA graph: ``replay()`` reruns the captured work on the same buffers.

    Made by :func:`capture_graph`, :class:`CUDAGraphWrapper` and
    :func:`make_graphed_train_step`. Its memory comes from ``pool``; graphs that never
    run at the same time can share one (pass ``pool=graph.pool`` to the next capture).
    """

    def __init__(self, pool: Any = None) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None  # made at capture, on a CUDA machine
        self._pool = pool
        self._captured = False

    @property
    def captured(self) -> bool:
        """Whether a capture completed (and :meth:`replay` may run)."""
        return self._captured

    @property
    def pool(self) -> Any:
        """The memory-pool handle of the graph's allocations."""
        return self._graph.pool() if self._captured else self._pool

    @property
    def torch_graph(self) -> torch.cuda.CUDAGraph | None:
        """The underlying ``torch.cuda.CUDAGraph`` (None before a capture)."""
        return self._graph

    def replay(self) -> None:
        """Launch the captured work on the current stream."""
        if not self._captured:
            raise UnsupportedOperationError("replay: nothing was captured in this graph")
        self._graph.replay()

    def close(self) -> None:
        """Free the graph (its pool's memory goes back to PyTorch's allocator)."""
        if self._graph is not None:
            self._graph.reset()
        self._captured = False

    @contextlib.contextmanager
    def _capturing(self, stream: torch.cuda.Stream | None, check: bool) -> Iterator[None]:
        if self._captured:
            raise UnsupportedOperationError("capture: this graph holds a capture already")
        self._graph = torch.cuda.CUDAGraph()
        checker = _CaptureChecker() if check else None
        try:
            with (
                annotate("cuda_graph.capture"),
                torch.cuda.graph(self._graph, pool=self._pool, stream=stream),
                checker if checker is not None else contextlib.nullcontext(),
            ):
                yield
        except UnsupportedOperationError:
            self._graph.reset()
            raise
        except RuntimeError as e:
            self._graph.reset()
            last = "" if checker is None or checker.last_op is None else (
                f" (the last op captured was {checker.last_op})"
            )  # fmt: skip
            raise CudaError(
                f"CUDA graph capture failed{last}: {e}. Captured work must stay on this "
                "device's streams, with no host syncs, CPU tensors or new shapes; a "
                "backward must not reach gradient accumulators made on another stream"
            ) from e
        self._captured = True


def capture_graph(
    warmup_iters: int = 3,
    pool: Any = None,
    *,
    stream: torch.cuda.Stream | None = None,
    check: bool = True,
) -> GraphCapture:
    """Capture GPU work into a CUDA graph: a ``with`` block, or a function.

    The seed documents' signature. ``with capture_graph() as graph:`` records the
    block's kernels into a :class:`CapturedGraph` (the block runs once, in capture mode,
    so it cannot warm itself up: run the work a few times before, as the documents'
    example does, keep the block's tensors, refill the inputs in place and
    ``graph.replay()``). ``capture_graph(warmup_iters)(fn)`` returns a function whose
    first call warms ``fn`` up ``warmup_iters`` times on a side stream, then captures it
    with static copies of its tensor arguments; later calls copy their arguments in and
    replay (a :class:`CUDAGraphWrapper` under the hood).

    Parameters
    ----------
    warmup_iters : int
        Eager runs before the capture of a wrapped function (lazy initialisation,
        cuBLAS workspaces and autotuning must happen outside the graph).
    pool : optional
        A memory-pool handle (``torch.cuda.graph_pool_handle()`` or another graph's
        ``pool``) to share; default: a private pool.
    stream : torch.cuda.Stream, optional
        The stream a ``with`` block is captured on; default: a side stream of PyTorch's.
    check : bool
        Refuse, naming the op, what a graph cannot hold (host reads, CPU tensors). The
        check routes the captured ops through a TorchDispatchMode, under which
        torch.compile'd code runs uncompiled (and stays uncompiled: Dynamo skips a
        frame it first meets under a dispatch mode for good): pass False for a block
        that calls compiled code (a wrapped function is checked in its first warm-up
        run instead).

    Raises
    ------
    UnsupportedOperationError
        No CUDA device; or an op that a CUDA graph cannot capture (named in the message).
    InvalidInputError
        ``warmup_iters`` is not an int >= 0.
    CudaError
        The driver refused the capture (the message names the last op).

    Examples
    --------
    >>> with xpt.capture_graph() as graph:                    # doctest: +SKIP
    ...     static_y = model(static_x)
    >>> static_x.copy_(next_x); graph.replay()                # doctest: +SKIP
    >>> step = xpt.capture_graph(warmup_iters=3)(train_step)  # doctest: +SKIP
    >>> loss = step(x, y)      # warm-up, capture; later calls replay   # doctest: +SKIP
    """
    require_cuda("capture_graph")
    return GraphCapture(warmup_iters, pool, stream, check)


class GraphCapture:
    """What :func:`capture_graph` returns: a context manager capturing its block, and a
    decorator capturing a function."""

    def __init__(self, warmup_iters: int, pool: Any, stream, check: bool) -> None:
        _check_warmup(warmup_iters)
        self._warmup, self._pool, self._stream, self._check = warmup_iters, pool, stream, check
        self._block: contextlib.AbstractContextManager[CapturedGraph] | None = None

    def __enter__(self) -> CapturedGraph:
        if self._block is not None:
            raise UnsupportedOperationError("capture_graph: this capture is in use already")
        self._block = _capture_block(CapturedGraph(self._pool), self._stream, self._check)
        return self._block.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        block, self._block = self._block, None
        return block.__exit__(*exc)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` graphed: the first call warms up and captures, later calls replay."""
        wrapper = CUDAGraphWrapper(warmup_iters=self._warmup, pool=self._pool, check=self._check)

        @functools.wraps(fn)
        def graphed(*args: Any, **kwargs: Any) -> Any:
            if wrapper.captured:
                return wrapper.replay(*args, **kwargs)
            return wrapper.capture(fn, *args, **kwargs)

        graphed.graph_wrapper = wrapper
        return graphed


@contextlib.contextmanager
def _capture_block(graph: CapturedGraph, stream, check: bool) -> Iterator[CapturedGraph]:
    with graph._capturing(stream, check):
        yield graph


def _check_warmup(warmup_iters: object) -> None:
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
        raise InvalidInputError(f"warmup_iters: expected an int >= 0, got {warmup_iters!r}")


class CUDAGraphWrapper:
    """Capture a function once (warm-up, static inputs and outputs) and replay it.

    Parameters
    ----------
    warmup_iters : int
        Eager runs on a side stream before capture (lazy initialisation and autotuning
        must happen outside the graph). Give a torch.compile'd ``fn`` at least two with
        ``check``: the first runs it uncompiled.
    pool : optional
        A memory-pool handle to share with other graphs.
    check : bool
        Refuse, naming the op, what a graph cannot hold (in the first warm-up run, or
        in the capture when there is none).

    Examples
    --------
    >>> graphed = xpt.CUDAGraphWrapper()                      # doctest: +SKIP
    >>> out = graphed.capture(model, x)                       # static output
    >>> out = graphed.replay(next_x)                          # same tensor, new values
    """

    def __init__(self, *, warmup_iters: int = 3, pool: Any = None, check: bool = True) -> None:
        _check_warmup(warmup_iters)
        self._warmup = warmup_iters
        self._graph = CapturedGraph(pool)
        self._check = check
        self._inputs: StaticInputs | None = None
        self._outputs: Any = None
        self._fn: Callable[..., Any] | None = None  # kept: the graph uses its tensors

    @property
    def captured(self) -> bool:
        """Whether :meth:`capture` has completed."""
        return self._graph.captured

    @property
    def graph(self) -> CapturedGraph:
        """The captured graph (its ``pool`` can be shared with the next capture)."""
        return self._graph

    @property
    def inputs(self) -> tuple[tuple, dict]:
        """The static ``(args, kwargs)`` the graph reads; write into them in place."""
        self._require_captured()
        return self._inputs.args, self._inputs.kwargs

    @property
    def outputs(self) -> Any:
        """The static outputs, rewritten by every :meth:`replay`."""
        self._require_captured()
        return self._outputs

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Warm ``fn`` up on a side stream, then capture ``fn(*args, **kwargs)``.

        Tensor arguments are copied to static device buffers that the graph reads;
        everything else is fixed at capture. Returns the static outputs.

        Raises
        ------
        InvalidInputError
            An argument tensor is not on a CUDA device (nor a CPU tensor to copy in).
        UnsupportedOperationError, CudaError
            ``fn`` does something a graph cannot hold (named in the message).
        """
        require_cuda("CUDAGraphWrapper.capture")
        if self.captured:
            raise UnsupportedOperationError(
                "CUDAGraphWrapper.capture: already captured; make a new wrapper (or close())"
            )
        self._fn = fn
        self._inputs = StaticInputs.of((args, kwargs), "CUDAGraphWrapper.capture")
        args, kwargs = self._inputs.args, self._inputs.kwargs
        check = warm_up(lambda: fn(*args, **kwargs), self._warmup, self._check)
        with self._graph._capturing(None, check):
            self._outputs = fn(*args, **kwargs)
        return self._outputs

    def replay(self, *args: Any, **kwargs: Any) -> Any:
        """Copy new arguments (if given) into the static inputs, replay, return the
        static outputs.

        Raises
        ------
        InvalidInputError
            The arguments' structure, a shape or a dtype differs from the capture's, or
            a non-tensor argument changed (the graph holds its captured value).
        """
        self._require_captured()
        if args or kwargs:
            self._inputs.fill((args, kwargs), "CUDAGraphWrapper.replay")
        self._graph.replay()
        return self._outputs

    __call__ = replay

    def close(self) -> None:
        """Free the graph and its static buffers."""
        self._graph.close()
        self._inputs = self._outputs = self._fn = None

    def _require_captured(self) -> None:
        if not self.captured:
            raise UnsupportedOperationError("CUDAGraphWrapper: call capture(fn, ...) first")


# -- helpers ---------------------------------------------------------------------------------
def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise UnsupportedOperationError(
            f"{what}: CUDA graphs need a CUDA device; none is available"
        )


def warm_up(
    fn: Callable[[], Any],
    iterations: int,
    check: bool,
    stream: torch.cuda.Stream | None = None,
    rehearse: bool = False,
) -> bool:
    """Run ``fn`` ``iterations`` times on a side stream, ordered after and before the
    current stream's work; with ``check``, one run refuses (by name) what a graph
    cannot hold. Returns whether the capture itself still needs the check (no warm-up).

    The check is a TorchDispatchMode, and torch.compile'd code runs uncompiled under
    one, so it runs in a warm-up rather than in the capture (there it would record the
    uncompiled kernels in the graph), and not in the last: the run after it compiles.
    With three warm-ups or more it is the second to last, since first calls do once what
    the capture will not: ``DistributedDataParallel(static_graph=True)`` marks the
    parameters used on its first step in a CPU tensor and rebuilds its buckets on the
    second. ``stream``: the side stream to run on (default: a new one). With
    ``rehearse``, the last run rehearses the capture: the ops take its paths, so that
    their kernels are compiled and loaded before it (:mod:`.._ops._infra._capture_paths`).
    """
    if iterations == 0:
        return check
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    _warming.depth = warming_up() + 1
    try:
        # The calls' kernels are chosen here, for the graph: auto times them as replays.
        with by_gpu_time(), torch.cuda.stream(side):
            checked = iterations - 2 if iterations >= 3 else 0
            for i in range(iterations):
                if check and i == checked:
                    run_checked(fn)
                elif rehearse and i == iterations - 1:
                    with rehearsal():
                        fn()
                else:
                    fn()
    finally:  # a refused op leaves the side stream's work ordered before what follows
        _warming.depth -= 1
        torch.cuda.current_stream().wait_stream(side)
    return False


_warming = threading.local()


def warming_up() -> int:
    """How many graph warm-ups run on this thread now (a step's layers then run as
    written, not from their own graphs: the step is captured whole)."""
    return getattr(_warming, "depth", 0)


def run_checked(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` once under the capture checks, with torch.compile off for the run.

    Dynamo does not compile a frame it first meets under a TorchDispatchMode, and marks
    that frame's code to be skipped from then on: a compiled model whose first call was
    checked would run uncompiled for good. Under the ``force_eager`` stance Dynamo does
    not look at those frames, so their first call outside the check compiles them.
    (``torch.compiler.disable`` would not do: a compiled function sets its own
    callback. PyTorch before 2.6 has no stance, and keeps the old behaviour.)
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    eager = set_stance("force_eager") if set_stance else contextlib.nullcontext()
    checker = _CaptureChecker()
    try:
        with checker, eager:
            return fn()
    except UnsupportedOperationError:
        raise
    except Exception as e:  # the refusal, lost on its way through C++ (an autograd hook)
        if checker.refused is not None:
            raise checker.refused from e
        raise


def unchecked() -> contextlib.AbstractContextManager:
    """The capture checks paused (for work PyTorch itself captures, whose bookkeeping
    the checks would misjudge: DistributedDataParallel's backward hooks)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


_BUFFER = object()  # a leaf refilled into its device buffer (the others must not change)


def _same_value(leaf: Any, captured: Any) -> bool:
    """Whether a non-tensor argument is the one the graph was captured with (None, a
    flag, a number)."""
    return leaf is captured or (type(leaf) is type(captured) and leaf == captured)


class StaticInputs:
    """Device buffers a graph reads, in the structure the caller gave, refilled in place."""

    def __init__(self, tree: Any, spec: Any, tensors: list[torch.Tensor], others: list[Any],
                 device: torch.device) -> None:  # fmt: skip
        self.tree = tree
        self._spec = spec
        self._tensors = tensors
        self._others = others
        self._device = device

    @classmethod
    def of(cls, tree: Any, what: str) -> StaticInputs:
        leaves, spec = pytree.tree_flatten(tree)
        device = torch.device("cuda", torch.cuda.current_device())
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                device = t.device
                break
        static, tensors, others = [], [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type not in ("cuda", "cpu"):
                    raise InvalidInputError(
                        f"{what}: tensor {i} is on {leaf.device}; expected CUDA or CPU"
                    )
                buffer = leaf.detach().to(device, copy=True).requires_grad_(leaf.requires_grad)
                static.append(buffer)
                tensors.append(buffer)
                others.append(_BUFFER)
            else:
                static.append(leaf)
                others.append(leaf)
        return cls(pytree.tree_unflatten(static, spec), spec, tensors, others, device)

    @property
    def args(self) -> tuple:
        return self.tree[0]

    @property
    def kwargs(self) -> dict:
        return self.tree[1]

    @property
    def device(self) -> torch.device:
        """The device of the buffers."""
        return self._device

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The device buffers, in the order of the structure's leaves."""
        return self._tensors

    def describe(self) -> str:
        return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in self._tensors)

    def fill(self, tree: Any, what: str) -> None:
        leaves, spec = pytree.tree_flatten(tree)
        if spec != self._spec:
            raise InvalidInputError(
                f"{what}: the structure {spec} differs from the captured {self._spec}"
            )
        buffers = iter(self._tensors)
        for i, (leaf, other) in enumerate(zip(leaves, self._others)):
            if other is not _BUFFER or not isinstance(leaf, torch.Tensor):
                if other is _BUFFER or not _same_value(leaf, other):
                    raise InvalidInputError(
                        f"{what}: argument {i} is {leaf!r}, captured as {other!r}; a graph "
                        "keeps the values it was captured with"
                    )
                continue
            buffer = next(buffers)
            if leaf.shape != buffer.shape or leaf.dtype != buffer.dtype:
                raise InvalidInputError(
                    f"{what}: tensor {i} is {tuple(leaf.shape)} {leaf.dtype}, but the graph "
                    f"was captured for {tuple(buffer.shape)} {buffer.dtype}; capture a new "
                    "graph for this shape (graphs can share a pool)"
                )
            if leaf is not buffer:
                buffer.copy_(leaf, non_blocking=True)

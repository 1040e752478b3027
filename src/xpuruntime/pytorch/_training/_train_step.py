"""Training steps: the eager step and the whole step captured as one CUDA graph, built from
one policy (kernels, precision, graph capture)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..._errors import InvalidInputError, UnsupportedOperationError
from ...kernels import dispatcher
from ...policies import KernelPolicy
from .._graphs.capture import (
    CapturedGraph,
    StaticInputs,
    describe,
    require_cuda,
    unchecked,
    warm_up,
)
from .._ops._infra._frozen_casts import forget_frozen_casts
from .._optimize._apply import OptimizationReport, optimize
from .._selection._autocast import autocast
from .._selection._policy import (
    by_gpu_time,
    current_state,
    forget_measured_decisions,
    get_kernel_policy,
)
from ._transformers import prepared_forward

__all__ = ["GraphedTrainStep", "TrainStep", "make_graphed_train_step", "make_train_step"]

_multithreading = torch.autograd.set_multithreading_enabled
_log = logging.getLogger("xpuruntime.pytorch.graphs")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
             "fp8_rowwise": torch.bfloat16}  # fmt: skip


class TrainStep:
    """An eager training step: ``zero_grad``, forward and loss (under the policy's
    precision), backward, ``optimizer.step()``; made by :func:`make_train_step`.

    With ``accumulation_steps=N`` the batch is split into N micro-batches along its
    first dimension; each one's loss (divided by N) is backpropagated, and the
    optimizer steps once. Under DDP the gradients are all-reduced on the last
    micro-batch only (``no_sync`` before it).

    When the model's parameters are on one device, the backward runs on the calling
    thread (``torch.autograd.set_multithreading_enabled(False)`` around the step), where
    PyTorch would hand a GPU's backward to its device thread: that thread exists for
    models spread over several devices, and on one device its hand-offs cost host time
    (GPT-2 124M at batch 4 on an H200: 3.6 ms of 27 ms per step). Each backward node
    written in Python pays it, which is why our ops' steps gain most; an own loop gets
    the same by wrapping its step in that context manager.

    Under a ``best_performance`` policy on a GPU, the first call also settles how the
    per-call ops' kernels are ranked (:attr:`kernels_by_gpu_time`): it times the whole
    step with the kernels ranked by GPU time alone (as in a CUDA graph) and with them
    ranked by eager call time (where a small op's host time counts), and keeps the
    faster (two alternating rounds of three steps each way). Kernel by kernel neither
    ranking predicts the step: a step whose host outpaces the GPU gains from GPU time
    saved, one bound by its host from host time saved. The trial steps' updates are
    undone (as a graph's warm-up's are); in a distributed job rank 0's choice holds."""

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        autocast_dtype: torch.dtype | None,
        max_grad_norm=None,
        accumulation_steps: int = 1,
    ) -> None:
        check_max_grad_norm(max_grad_norm)
        self.accumulation_steps = _accumulation(accumulation_steps)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._dtype = autocast_dtype
        self._device = next(model.parameters()).device
        self._one_device = len({p.device for p in model.parameters()}) == 1
        self._by_gpu_time: bool | None = None  # settled by the first call
        # fp16 needs loss scaling; bf16 and fp32 have fp32's exponent range.
        self.grad_scaler = (
            torch.amp.GradScaler(self._device.type) if autocast_dtype == torch.float16 else None
        )

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one step on ``(inputs, targets)``, or on a mapping (a transformers batch:
        ``model(**batch)``, targets None); returns the loss (detached)."""
        batch = tuple(_to(t, self._device) for t in as_pair(batch, "train step"))
        # On one device, the backward on this thread (see the class).
        with _multithreading(False) if self._one_device else contextlib.nullcontext():
            if self._by_gpu_time is None:
                self._by_gpu_time = self._faster_ranking(batch)
            with by_gpu_time(afresh=False) if self._by_gpu_time else contextlib.nullcontext():
                return self._step(batch)

    @property
    def kernels_by_gpu_time(self) -> bool | None:
        """Whether the per-call ops' measured choices rank kernels by GPU time alone
        (True) or by eager call time (False); None before the first call."""
        return self._by_gpu_time

    def _step(self, batch: tuple[Any, Any]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if self.accumulation_steps == 1:
            _, loss = forward_and_loss(
                self.model, self.loss_fn, batch, self._dtype, self._device.type
            )
            backward_and_step(
                loss, self.model, self.optimizer, self.grad_scaler, self.max_grad_norm
            )
            return loss.detach()
        return self._accumulate(batch)

    def _faster_ranking(self, batch: tuple[Any, Any], steps: int = 3, rounds: int = 2) -> bool:
        """Whether the step runs faster with the kernels auto measures ranked by GPU
        time: ``steps`` steps on ``batch`` timed each way after one that makes the
        choices, in ``rounds`` alternating rounds (the first also measures the kernels,
        and a graph capture empties PyTorch's allocator cache, which the next steps
        refill: the faster round of each way counts). The model and optimizer are put
        back as they were. False without measured choices (no ``best_performance``
        policy, or not on a GPU)."""
        policy = current_state().policy
        if policy is None or policy.auto_strategy != "best_performance":
            return False
        if self._device.type != "cuda":
            return False
        saved = _TrainingState(self.model, self.optimizer, self.grad_scaler)
        seconds = {True: float("inf"), False: float("inf")}
        try:
            for _, gpu in itertools.product(range(rounds), (True, False)):
                forget_measured_decisions()
                with by_gpu_time(afresh=False) if gpu else contextlib.nullcontext():
                    self._step(batch)  # the choices are made here
                    torch.cuda.synchronize(self._device)
                    start = time.perf_counter()
                    for _ in range(steps):
                        self._step(batch)
                    torch.cuda.synchronize(self._device)
                seconds[gpu] = min(seconds[gpu], (time.perf_counter() - start) / steps)
        finally:
            saved.restore()
            self.optimizer.zero_grad(set_to_none=True)
            forget_measured_decisions()  # made again, from the measurements, as chosen
        found = (seconds[True] <= seconds[False], "", seconds)
        if dispatcher.consensus is not None:  # a distributed job: rank 0's choice
            found = dispatcher.consensus("train_step", found)
        _log.info(
            "eager train step: kernels ranked by %s (%.2f ms per step by GPU time, %.2f ms "
            "by call time)",
            "GPU time" if found[0] else "call time", 1e3 * found[2][True], 1e3 * found[2][False],
        )  # fmt: skip
        return found[0]

    def _accumulate(self, batch: tuple[Any, Any]) -> torch.Tensor:

        n = self.accumulation_steps
        leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
        rows = {t.shape[0] for t in leaves if t.ndim}
        if len(rows) != 1 or next(iter(rows)) % n:
            raise InvalidInputError(
                f"train step: accumulation_steps={n} splits the batch along its first "
                f"dimension, which must be the same for every tensor and divisible by {n}; "
                f"got first dimensions {sorted(rows)}"
            )
        micro = [
            pytree.tree_map_only(torch.Tensor, lambda t, i=i: t.chunk(n)[i], batch)
            for i in range(n)
        ]
        no_sync = getattr(self.model, "no_sync", None)  # DDP: all-reduce once, at the end
        total = None
        for i, part in enumerate(micro):
            last = i == n - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                _, loss = forward_and_loss(
                    self.model, self.loss_fn, part, self._dtype, self._device.type
                )
                scaled = loss / n
                if last:
                    backward_and_step(
                        scaled, self.model, self.optimizer, self.grad_scaler, self.max_grad_norm
                    )
                elif self.grad_scaler is not None:
                    self.grad_scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            total = scaled.detach() if total is None else total + scaled.detach()
        return total


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    cuda_graph: bool | None = None,
    max_grad_norm: float | None = None,
    compile_model: bool = False,
    accumulation_steps: int = 1,
) -> tuple[TrainStep | GraphedTrainStep, OptimizationReport]:
    """Build a training step as ``policy`` says: kernels (by :func:`optimize`),
    precision (``policy.precision``) and graph capture (``policy.cuda_graph``).

    Parameters
    ----------
    model, loss_fn, optimizer, sample_batch
        As :func:`make_graphed_train_step` (``optimizer`` capturable when the step is
        captured). A batch may be a mapping, as transformers' are: the model is called
        as ``model(**batch)`` and ``loss_fn(output, None)``, for instance
        ``lambda out, _: out.loss`` with ``labels`` in the batch.
    policy : KernelPolicy, dict, path or None
        Set process-wide (as :func:`set_kernel_policy`); None keeps the one in force.
    cuda_graph : bool, optional
        Capture the step as one CUDA graph (True) or not (False); None follows the
        policy's ``cuda_graph``.
    max_grad_norm : float, optional
        Clip the gradients' global norm before each optimizer step.
    compile_model : bool
        Run the model through ``torch.compile`` once :func:`optimize` has rewritten it,
        so that compile's fusions and the policy's kernels combine (our ops trace as
        registered torch ops). A model compiled before this call is rewritten too, but
        for the ``torch.fx`` rewrites a policy names (``optimize`` lists them in
        ``skipped``).
    accumulation_steps : int
        Split each batch into this many micro-batches and step once (eager steps; under
        DDP the gradients are reduced once per step).

    Returns
    -------
    (step, report)
        ``step(batch) -> loss``; ``report`` says what :func:`optimize` changed (its
        ``revert()`` undoes it).

    Raises
    ------
    InvalidInputError, PolicyError
        As :func:`make_graphed_train_step` and :func:`optimize`.

    Notes
    -----
    A model wrapped in ``DistributedDataParallel`` or ``fully_shard`` (FSDP2) works as
    is, the policy checked across ranks. A graphed step (``policy.cuda_graph``) of a DDP
    model needs it built by :func:`distributed.data_parallel` (``static_graph=True``,
    made on a side stream), under which PyTorch can capture its all-reduce; an FSDP2
    model's graphed step is refused (its all-gathers and reduce-scatters are not
    captured).

    ``precision='fp16'`` adds loss scaling (``torch.amp.GradScaler``); in a CUDA graph
    that needs an optimizer that applies the scale on the device (``fused=True``).

    Examples
    --------
    >>> policy = {"precision": "bf16", "cuda_graph": True,
    ...           "kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"}}
    >>> step, report = xpt.make_train_step(model, loss_fn, opt, (x, y), policy)  # doctest: +SKIP
    """
    check_step_parts(loss_fn, optimizer)
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise InvalidInputError(f"cuda_graph: expected True, False or None, got {cuda_graph!r}")
    report = optimize(model, policy)
    if policy is None:  # optimize set nothing: the policy in force must match too
        from ..distributed._ranks import check_policy, is_initialized

        if is_initialized():
            check_policy(get_kernel_policy())
    active = get_kernel_policy() or KernelPolicy()
    dtype = _AUTOCAST.get(active.precision)
    try:
        if compile_model:
            model = torch.compile(model)
        if active.cuda_graph if cuda_graph is None else cuda_graph:
            _check_graphable(model, accumulation_steps)
            scaler = None
            if dtype == torch.float16:
                scaler = torch.amp.GradScaler("cuda")
            try:
                step: TrainStep | GraphedTrainStep = make_graphed_train_step(
                    model, loss_fn, optimizer, sample_batch, autocast_dtype=dtype,
                    grad_scaler=scaler, max_grad_norm=max_grad_norm,
                )  # fmt: skip
            except UnsupportedOperationError as error:  # (what the capture cannot hold)
                hint = _packed_rows_hint(sample_batch, active)
                if hint is None:
                    raise
                raise UnsupportedOperationError(f"{error}. {hint}") from error
        else:
            step = TrainStep(model, loss_fn, optimizer, dtype, max_grad_norm, accumulation_steps)
    except Exception:
        report.revert()
        raise
    return step, report


def _packed_rows_hint(batch: Any, policy: KernelPolicy) -> str | None:
    """What a graphed step of a batch given positions may lack where it failed: the
    policy's ``packed_sequences`` (transformers reads the positions on the host to look
    for packed sequences). None where the batch has no positions or the policy says so."""
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if positions is None or policy.packed_sequences:
        return None
    return (
        "The batch gives position_ids, and transformers reads their values on the host "
        "to look for packed sequences. Where its rows are packed (TRL's padding-free "
        "batches), the policy's packed_sequences makes their documents on the device"
    )


def _accumulation(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidInputError(f"accumulation_steps: expected an int >= 1, got {steps!r}")
    return steps


def _check_graphable(model: torch.nn.Module, accumulation_steps: int) -> None:
    """Refuse, with the reason, graphed steps PyTorch cannot capture."""
    if _accumulation(accumulation_steps) != 1:
        raise UnsupportedOperationError(
            "a graphed step (policy.cuda_graph) runs one batch per replay; accumulate "
            "gradients with an eager step (cuda_graph=False)"
        )
    from ..distributed._ranks import CAPTURABLE

    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not (
        getattr(model, "static_graph", False) and getattr(model, CAPTURABLE, False)
    ):
        raise UnsupportedOperationError(
            "a graphed step of a DistributedDataParallel model needs it built by "
            "xpt.distributed.data_parallel(model): PyTorch captures DDP's backward only "
            "with static_graph=True and the wrapper made on a side stream, not the "
            "default one"
        )
    if type(model).__name__.startswith("FSDP") or hasattr(model, "reshard"):
        raise UnsupportedOperationError(
            "a graphed step of an FSDP2 (fully_shard) model is refused: its all-gathers and "
            "reduce-scatters are not captured by CUDA graphs; use an eager step "
            "(cuda_graph=False)"
        )


def _to(tree: Any, device: torch.device) -> Any:

    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), tree)


class GraphedTrainStep:
    """A training step captured as one CUDA graph; made by :func:`make_graphed_train_step`.

    Calling it with a batch shaped like the sample batch copies the batch into the
    static buffers, replays forward, loss, backward and the optimizer step, and returns
    the loss (a fresh device tensor; reading it with ``.item()`` waits for the step).
    """

    def __init__(
        self,
        graph: CapturedGraph,
        inputs: StaticInputs,
        loss: torch.Tensor,
        output: Any,
        kept: tuple[
            torch.nn.Module,
            Callable[..., Any],
            Any,
            torch.optim.Optimizer,
            torch.amp.GradScaler | None,
        ],
    ) -> None:
        self._graph = graph
        self._inputs = inputs
        self._loss = loss
        self._output = output
        # The graph reads and writes the very tensors of the model, the forward it
        # captured (masks built before capture), the loss function, the optimizer (its
        # state, a tensor learning rate) and the grad scaler (its scale): they must live
        # as long as the graph, or their memory would be handed to other tensors and
        # overwritten by replays.
        self._model, self._forward, self._loss_fn, self._optimizer, self._grad_scaler = kept

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler whose scale the graph updates (None without one)."""
        return self._grad_scaler

    @property
    def model(self) -> torch.nn.Module:
        """The model the step trains."""
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose step is captured (its state is the graph's)."""
        return self._optimizer

    @property
    def graph(self) -> CapturedGraph:
        """The captured graph."""
        return self._graph

    @property
    def batch(self) -> Any:
        """The static batch the graph reads (same structure as the sample batch)."""
        return self._inputs.tree

    @property
    def output(self) -> Any:
        """The model's static output, rewritten by every step."""
        return self._output

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one step on ``batch``; returns its loss.

        Raises
        ------
        InvalidInputError
            ``batch`` differs from the sample batch in structure, shape or dtype (the
            message names which tensor). A new shape needs a new step: call
            :func:`make_graphed_train_step` with a sample of it (graphs of several
            shapes can share one pool).
        """
        self._inputs.fill(as_pair(batch, "train step"), "train step")
        self._graph.replay()
        return self._loss.detach().clone()

    def close(self) -> None:
        """Free the graph (the model keeps its parameters and optimizer state)."""
        self._graph.close()


def make_graphed_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    sample_batch: tuple[Any, Any],
    *,
    autocast_dtype: torch.dtype | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    warmup_steps: int = 3,
    restore_state: bool = True,
    pool: Any = None,
    check: bool = True,
) -> GraphedTrainStep:
    """Capture ``loss_fn(model(inputs), targets)``, its backward and ``optimizer.step()``
    as one CUDA graph.

    The warm-up runs real steps on a side stream (so that lazy state, cuBLAS workspaces
    and autotuning exist before capture); parameters, buffers and optimizer state are
    restored afterwards, so the first call is the model's first step. Gradients are
    written, not accumulated: each call is ``zero_grad(set_to_none=True)`` + one step.

    Parameters
    ----------
    model : nn.Module
        On a CUDA device; called as ``model(inputs)`` (``model(*inputs)`` for a tuple,
        ``model(**inputs)`` for a mapping).
    loss_fn : callable
        ``loss_fn(output, targets)`` returning a scalar tensor.
    optimizer : torch.optim.Optimizer
        Must be capturable where it has the option (``AdamW(..., fused=True,
        capturable=True)``). A Python-float learning rate is fixed at capture: pass
        ``lr`` as a CUDA tensor and update it in place to schedule it.
    sample_batch : (inputs, targets)
        Tensors (or nested tuples/lists/dicts of them) of the shapes and dtypes every
        batch will have; CPU tensors are fine (each call copies the batch in).
    autocast_dtype : torch.float16 or torch.bfloat16, optional
        Run forward and loss under :func:`autocast` (its weight cache off, as graphs
        need).
    grad_scaler : torch.amp.GradScaler, optional
        Loss scaling for fp16: the loss is scaled, the gradients unscaled and checked,
        and the step skipped and the scale updated on the device. The optimizer must
        apply the scale itself (a fused one: ``fused=True``), since the unfused path
        reads ``found_inf`` back to the host.
    max_grad_norm : float, optional
        Clip the gradients' global norm to this before the optimizer step
        (``clip_grad_norm_``, computed on the device: no host sync).
    warmup_steps : int
        Eager steps before capture. Give a torch.compile'd model at least two with
        ``check``: the first runs it uncompiled.
    restore_state : bool
        Put the trained parameters, buffers and optimizer state back after the warm-up
        (it costs a copy of them in pinned host memory while capturing; frozen
        parameters outside the optimizer are neither copied nor written). False: the
        warm-up steps are real training steps on the sample batch.
    pool : optional
        A memory-pool handle to share with graphs of other shapes.
    check : bool
        Refuse, naming the op, what a graph cannot hold (in the first warm-up step, or in
        the capture when there is none).

    Returns
    -------
    GraphedTrainStep
        ``step(batch) -> loss``.

    Raises
    ------
    InvalidInputError
        The model, optimizer or sample batch is not usable (the message says which).
    UnsupportedOperationError, CudaError
        The step does something a graph cannot hold (the op is named).

    Examples
    --------
    >>> opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)  # doctest: +SKIP
    >>> step = xpt.make_graphed_train_step(model, F.cross_entropy, opt, (x, y),
    ...                                    autocast_dtype=torch.bfloat16)         # doctest: +SKIP
    >>> for x, y in loader:                                                       # doctest: +SKIP
    ...     loss = step((x, y))
    """
    require_cuda("make_graphed_train_step")
    _check_train_step_args(model, loss_fn, optimizer, sample_batch, warmup_steps, max_grad_norm)
    inputs = StaticInputs.of(as_pair(sample_batch, "sample_batch"), "sample_batch")
    forward = _forward_to_capture(model, loss_fn, inputs.tree, autocast_dtype)

    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)

    def step() -> tuple[Any, torch.Tensor]:
        # Autocast's weight cache would hand the graph casts made outside it.
        out, loss = forward_and_loss(forward, loss_fn, inputs.tree, autocast_dtype, "cuda", False)
        # DDP's backward runs its reducer's hooks, whose all-reduce PyTorch captures
        # (static graph, side stream) and whose host bookkeeping the checks would refuse
        # from inside C++: the checks cover the forward and the loss there.
        with unchecked() if ddp else contextlib.nullcontext():
            backward_and_step(loss, model, optimizer, grad_scaler, max_grad_norm)
        return out, loss

    def warm_up_step() -> None:
        # Nothing of a warm-up step may outlive it: a live output keeps its autograd
        # graph alive, and PyTorch then accumulates the captured step's gradients on the
        # warm-up's stream (it warns of the stream mismatch) instead of the capture's.
        optimizer.zero_grad(set_to_none=True)
        step()

    if grad_scaler is not None and not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise InvalidInputError(
            f"grad_scaler: {type(optimizer).__name__} does not apply the loss scale on the "
            "device, so GradScaler.step would read found_inf back to the host inside the "
            "graph; create the optimizer with fused=True"
        )
    stream = None
    if ddp:
        # DDP rebuilds its buckets and samples its timing on early steps, outside what
        # a replay repeats: PyTorch asks for 11 eager steps before capturing it. Its
        # gradient accumulators run on the stream it was built on: warm-up and capture
        # run there too (xpt.distributed.data_parallel's).
        warmup_steps = max(warmup_steps, 11)
        from ..distributed._ranks import SIDE_STREAM

        stream = getattr(model, SIDE_STREAM, None)
    saved = _TrainingState(model, optimizer, grad_scaler) if restore_state else None
    graph = CapturedGraph(pool)
    try:
        check = warm_up(warm_up_step, warmup_steps, check, stream)
        optimizer.zero_grad(set_to_none=True)
        # The graph makes its own casts of frozen weights: the warm-up's kept copies
        # would only hold memory beside them.
        forget_frozen_casts()
        with graph._capturing(stream, check):
            output, loss = step()
    finally:
        if saved is not None:
            saved.restore()
    _log.info("captured a training step for batch %s", inputs.describe())
    kept = (model, forward, loss_fn, optimizer, grad_scaler)
    return GraphedTrainStep(graph, inputs, loss, output, kept)


def _forward_to_capture(
    model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], batch: tuple[Any, Any],
    autocast_dtype: torch.dtype | None,
) -> Callable[..., Any]:  # fmt: skip
    """``model``, or for a transformers model its forward with the attention masks built
    before capture and no KV cache, where that computes the same loss."""
    prepared = prepared_forward(model, batch[0])
    if prepared is None:
        return model
    if not prepared.agrees(
        lambda f: forward_and_loss(f, loss_fn, batch, autocast_dtype, "cuda")[1]
    ):
        _log.info("%s: called as it is (its own masks differ from those built before "
                  "capture)", type(getattr(model, "module", model)).__name__)  # fmt: skip
        return model
    return prepared


# -- the step's parts, shared by the eager and the graphed step --------------------------
def check_step_parts(loss_fn: object, optimizer: object) -> None:
    """Refuse a ``loss_fn`` that is not callable or an ``optimizer`` that is not one."""
    if not callable(loss_fn):
        raise InvalidInputError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def check_max_grad_norm(value: object) -> None:
    """Refuse a ``max_grad_norm`` that is neither None nor a number > 0."""
    if value is not None and not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    ):
        raise InvalidInputError(f"max_grad_norm: expected a number > 0 or None, got {value!r}")


def forward_and_loss(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batch: tuple[Any, Any],
    autocast_dtype: torch.dtype | None,
    device_type: str,
    cache_enabled: bool = True,
) -> tuple[Any, torch.Tensor]:
    """``model(inputs)`` (``model(*inputs)`` for a tuple, ``model(**inputs)`` for a
    mapping) and ``loss_fn(output, targets)``,
    under :func:`autocast` when ``autocast_dtype`` is set; checks the loss is a scalar."""
    x, y = batch
    with autocast(autocast_dtype, cache_enabled=cache_enabled, device_type=device_type) if (
        autocast_dtype is not None
    ) else contextlib.nullcontext():  # fmt: skip
        if isinstance(x, Mapping):
            out = model(**x)
        else:
            out = model(*x) if isinstance(x, tuple) else model(x)
        loss = loss_fn(out, y)
    if loss is None:
        raise InvalidInputError(
            "loss_fn must return a scalar tensor, got None (a transformers model computes "
            "its .loss only when the batch has labels: put labels in the batch, or compute "
            "the loss from out.logits and the targets)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InvalidInputError(f"loss_fn must return a scalar tensor, got {describe(loss)}")
    return out, loss


def as_pair(batch: Any, what: str) -> tuple[Any, Any]:
    """``batch`` as (inputs, targets): a mapping (a transformers batch) is its inputs,
    with no targets."""
    if isinstance(batch, Mapping):
        return batch, None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InvalidInputError(
            f"{what}: expected an (inputs, targets) pair or a mapping of the model's "
            f"arguments, got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return tuple(batch)


def backward_and_step(
    loss: torch.Tensor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
) -> None:
    """Backward, optional clipping, and the optimizer step (through ``scaler`` if any)."""
    if scaler is None:
        loss.backward()
        clip_gradients(model, max_grad_norm)
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if max_grad_norm is not None:
        scaler.unscale_(optimizer)
        clip_gradients(model, max_grad_norm)
    scaler.step(optimizer)
    scaler.update()


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> None:
    """Clip the gradients' global norm to ``max_norm`` (None: nothing), on the device."""
    if max_norm is not None:
        grads = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)


def _check_train_step_args(
    model, loss_fn, optimizer, sample_batch, warmup_steps, max_grad_norm=None
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_step_parts(loss_fn, optimizer)
    as_pair(sample_batch, "sample_batch")
    check_max_grad_norm(max_grad_norm)
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise InvalidInputError(
            f"warmup_steps: expected an int >= 1 (optimizers create their state in the "
            f"first step, outside the graph), got {warmup_steps!r}"
        )
    from ..distributed._ranks import OPTIMIZER_SHARDS

    if getattr(optimizer, OPTIMIZER_SHARDS, None) is not None:
        raise InvalidInputError(
            "optimizer: sharded by shard_optimizer, whose gathers a graph cannot replay; "
            "pass the optimizer unsharded to a graphed step"
        )
    devices = {p.device for p in model.parameters()}
    if any(d.type != "cuda" for d in devices):
        raise InvalidInputError(
            f"model: every parameter must be on a CUDA device, found {sorted(map(str, devices))}"
        )
    for i, group in enumerate(optimizer.param_groups):
        if "capturable" in group and not group["capturable"]:
            raise InvalidInputError(
                f"optimizer: {type(optimizer).__name__} param group {i} has capturable=False; "
                f"create it with capturable=True (a graph replays its step on the device)"
            )
        if isinstance(group.get("lr"), float):
            warnings.warn(
                f"make_graphed_train_step: {type(optimizer).__name__}'s lr={group['lr']} is "
                "fixed at capture; pass lr as a CUDA tensor and update it in place to "
                "schedule it",
                stacklevel=3,
            )
            break


class _TrainingState:
    """What a training step writes (the parameters it trains, the buffers, optimizer
    state), saved to host memory before a warm-up and put back in place after capture
    (the graph holds these very tensors). Host copies, so that the warm-up and the
    capture peak no higher than the step itself; frozen parameters no step writes
    (a LoRA model's base) are not copied."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._scaler = scaler
        live = _scaler_tensors(scaler)
        self._scale = None if live is None else tuple(t.clone() for t in live)
        tensors = [p for p in model.parameters() if p.requires_grad] + list(model.buffers())
        tensors += [p for g in optimizer.param_groups for p in g["params"]]
        unique = {id(t): t for t in tensors}
        self._tensors = [(t, _on_host(t)) for t in unique.values()]
        self._state = {
            id(p): {k: _on_host(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        if any(t.is_cuda for t in unique.values()):
            torch.cuda.synchronize()  # the copies are asynchronous into pinned memory

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self._tensors:
                t.copy_(saved)
            # State created by the warm-up is zeroed in place: the initial value of
            # Adam-family moments and step counters (the graph holds these tensors).
            for p, state in self._optimizer.state.items():
                before = self._state.get(id(p), {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        old = before.get(key)
                        value.copy_(old) if isinstance(old, torch.Tensor) else value.zero_()
                    elif key in before:
                        state[key] = before[key]
                    elif isinstance(value, (int, float)):
                        state[key] = type(value)(0)
            # The loss scale and its growth tracker: as before, or as GradScaler starts.
            now = _scaler_tensors(self._scaler)
            if now is not None:
                scale, tracker = now
                if self._scale is not None:
                    scale.copy_(self._scale[0])
                    tracker.copy_(self._scale[1])
                else:
                    scale.fill_(self._scaler._init_scale)
                    tracker.fill_(self._scaler._init_growth_tracker)


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory (pinned where it is on a GPU)."""
    tensor = tensor.detach()
    if not tensor.is_cuda:
        return tensor.clone()
    copy = torch.empty_like(tensor, device="cpu", pin_memory=True)
    return copy.copy_(tensor, non_blocking=True)


def _scaler_tensors(scaler) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GradScaler's own (scale, growth tracker) tensors; None before its first use."""
    if scaler is None or getattr(scaler, "_scale", None) is None:
        return None
    return scaler._scale, scaler._growth_tracker

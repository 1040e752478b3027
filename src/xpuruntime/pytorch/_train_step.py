"""One policy for a whole training step: kernels, precision and graph capture."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import InvalidInputError
from ..policies import KernelPolicy
from ._graphs import (
    GraphedTrainStep,
    backward_and_step,
    check_max_grad_norm,
    check_step_parts,
    forward_and_loss,
    make_graphed_train_step,
)
from ._optimize import OptimizationReport, optimize
from ._policy import get_kernel_policy

__all__ = ["TrainStep", "make_train_step"]

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainStep:
    """An eager training step: ``zero_grad``, forward and loss (under the policy's
    precision), backward, ``optimizer.step()``; made by :func:`make_train_step`.

    With ``accumulation_steps=N`` the batch is split into N micro-batches along its
    first dimension; each one's loss (divided by N) is backpropagated, and the
    optimizer steps once. Under DDP the gradients are all-reduced on the last
    micro-batch only (``no_sync`` before it)."""

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
        # fp16 needs loss scaling; bf16 and fp32 have fp32's exponent range.
        self.grad_scaler = (
            torch.amp.GradScaler(self._device.type) if autocast_dtype == torch.float16 else None
        )

    def __call__(self, batch: tuple[Any, Any]) -> torch.Tensor:
        """Run one step on ``(inputs, targets)``; returns the loss (detached)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise InvalidInputError(
                f"train step: expected an (inputs, targets) pair, got {type(batch).__name__}"
            )
        batch = tuple(_to(t, self._device) for t in batch)
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

    def _accumulate(self, batch: tuple[Any, Any]) -> torch.Tensor:
        from torch.utils import _pytree as pytree

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
    sample_batch: tuple[Any, Any],
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    max_grad_norm: float | None = None,
    compile_model: bool = False,
    accumulation_steps: int = 1,
) -> tuple[TrainStep | GraphedTrainStep, OptimizationReport]:
    """Build a training step as ``policy`` says: kernels (by :func:`optimize`),
    precision (``policy.precision``) and graph capture (``policy.cuda_graph``).

    Parameters
    ----------
    model, loss_fn, optimizer, sample_batch
        As :func:`make_graphed_train_step` (``optimizer`` capturable when the policy
        captures a graph).
    policy : KernelPolicy, dict, path or None
        Set process-wide (as :func:`set_kernel_policy`); None keeps the one in force.
    max_grad_norm : float, optional
        Clip the gradients' global norm before each optimizer step.
    compile_model : bool
        Run the model through ``torch.compile`` once :func:`optimize` has rewritten it,
        so that compile's fusions and the policy's kernels combine (our ops trace as
        registered torch ops). A model compiled before this call is not rewritten
        (``optimize`` lists it in ``skipped``): pass the eager model and this flag.
    accumulation_steps : int
        Split each batch into this many micro-batches and step once (eager steps; under
        DDP the gradients are reduced once per step).

    A model wrapped in ``DistributedDataParallel`` or ``fully_shard`` (FSDP2) works as
    is, the policy checked across ranks. A graphed step (``policy.cuda_graph``) of a DDP
    model needs ``DistributedDataParallel(..., static_graph=True)``, under which PyTorch
    can capture its all-reduce; an FSDP2 model's graphed step is refused (its
    all-gathers and reduce-scatters are not captured).

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
    ``precision='fp16'`` adds loss scaling (``torch.amp.GradScaler``); in a CUDA graph
    that needs an optimizer that applies the scale on the device (``fused=True``).

    Examples
    --------
    >>> policy = {"precision": "bf16", "cuda_graph": True,
    ...           "kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"}}
    >>> step, report = xpt.make_train_step(model, loss_fn, opt, (x, y), policy)  # doctest: +SKIP
    """
    check_step_parts(loss_fn, optimizer)
    report = optimize(model, policy)
    if policy is None:  # optimize set nothing: the policy in force must match too
        from .distributed import check_policy, is_initialized

        if is_initialized():
            check_policy(get_kernel_policy())
    active = get_kernel_policy() or KernelPolicy()
    dtype = _AUTOCAST.get(active.precision)
    try:
        if compile_model:
            model = torch.compile(model)
        if active.cuda_graph:
            _check_graphable(model, accumulation_steps)
            scaler = None
            if dtype == torch.float16:
                scaler = torch.amp.GradScaler("cuda")
            step: TrainStep | GraphedTrainStep = make_graphed_train_step(
                model, loss_fn, optimizer, sample_batch, autocast_dtype=dtype,
                grad_scaler=scaler, max_grad_norm=max_grad_norm,
            )  # fmt: skip
        else:
            step = TrainStep(model, loss_fn, optimizer, dtype, max_grad_norm, accumulation_steps)
    except Exception:
        report.revert()
        raise
    return step, report


def _accumulation(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidInputError(f"accumulation_steps: expected an int >= 1, got {steps!r}")
    return steps


def _check_graphable(model: torch.nn.Module, accumulation_steps: int) -> None:
    """Refuse, with the reason, graphed steps PyTorch cannot capture."""
    from .._errors import UnsupportedOperationError

    if _accumulation(accumulation_steps) != 1:
        raise UnsupportedOperationError(
            "a graphed step (policy.cuda_graph) runs one batch per replay; accumulate "
            "gradients with an eager step (cuda_graph=False)"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not getattr(
        model, "static_graph", False
    ):
        raise UnsupportedOperationError(
            "a graphed step of a DistributedDataParallel model needs "
            "DistributedDataParallel(..., static_graph=True): only then can PyTorch "
            "capture its gradient all-reduce in a CUDA graph"
        )
    if type(model).__name__.startswith("FSDP") or hasattr(model, "reshard"):
        raise UnsupportedOperationError(
            "a graphed step of an FSDP2 (fully_shard) model is refused: its all-gathers and "
            "reduce-scatters are not captured by CUDA graphs; use an eager step "
            "(cuda_graph=False)"
        )


def _to(tree: Any, device: torch.device) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), tree)

"""One policy for a whole training step: kernels, precision and graph capture."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import InvalidInputError, UnsupportedOperationError
from ..policies import KernelPolicy
from ._autocast import autocast
from ._graphs import (
    GraphedTrainStep,
    check_max_grad_norm,
    clip_gradients,
    make_graphed_train_step,
)
from ._optimize import OptimizationReport, optimize
from ._policy import get_kernel_policy

__all__ = ["TrainStep", "make_train_step"]

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainStep:
    """An eager training step: ``zero_grad``, forward and loss (under the policy's
    precision), backward, ``optimizer.step()``; made by :func:`make_train_step`."""

    def __init__(
        self, model, loss_fn, optimizer, autocast_dtype: torch.dtype | None, max_grad_norm=None
    ) -> None:
        check_max_grad_norm(max_grad_norm)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._dtype = autocast_dtype
        self._device = next(model.parameters()).device

    def __call__(self, batch: tuple[Any, Any]) -> torch.Tensor:
        """Run one step on ``(inputs, targets)``; returns the loss (detached)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise InvalidInputError(
                f"train step: expected an (inputs, targets) pair, got {type(batch).__name__}"
            )
        x, y = (_to(t, self._device) for t in batch)
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self._dtype, device_type=self._device.type) if (
            self._dtype is not None
        ) else contextlib.nullcontext():  # fmt: skip
            out = self.model(*x) if isinstance(x, tuple) else self.model(x)
            loss = self.loss_fn(out, y)
        loss.backward()
        clip_gradients(self.model, self.max_grad_norm)
        self.optimizer.step()
        return loss.detach()


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    sample_batch: tuple[Any, Any],
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    max_grad_norm: float | None = None,
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

    Returns
    -------
    (step, report)
        ``step(batch) -> loss``; ``report`` says what :func:`optimize` changed (its
        ``revert()`` undoes it).

    Raises
    ------
    UnsupportedOperationError
        ``precision='fp16'``: fp16 training needs loss scaling, which reads a value back
        to the host each step (use bf16).
    InvalidInputError, PolicyError
        As :func:`make_graphed_train_step` and :func:`optimize`.

    Examples
    --------
    >>> policy = {"precision": "bf16", "cuda_graph": True,
    ...           "kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"}}
    >>> step, report = xpt.make_train_step(model, loss_fn, opt, (x, y), policy)  # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not callable(loss_fn):
        raise InvalidInputError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    report = optimize(model, policy)
    active = get_kernel_policy() or KernelPolicy()
    if active.precision == "fp16":
        report.revert()
        raise _fp16_refusal()
    dtype = _AUTOCAST.get(active.precision)
    try:
        if active.cuda_graph:
            step: TrainStep | GraphedTrainStep = make_graphed_train_step(
                model, loss_fn, optimizer, sample_batch, autocast_dtype=dtype,
                max_grad_norm=max_grad_norm,
            )  # fmt: skip
        else:
            step = TrainStep(model, loss_fn, optimizer, dtype, max_grad_norm)
    except Exception:
        report.revert()
        raise
    return step, report


def _fp16_refusal() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "make_train_step: precision='fp16' needs loss scaling (torch.amp.GradScaler), whose "
        "step reads a value back to the host; use precision='bf16', or build the step "
        "yourself with a GradScaler"
    )


def _to(tree: Any, device: torch.device) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), tree)

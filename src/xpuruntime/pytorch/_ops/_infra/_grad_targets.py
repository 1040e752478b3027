"""Where a parameter's gradient is written when another buffer will hold it anyway.

``DistributedDataParallel`` with ``gradient_as_bucket_view`` reduces gradients in flat
buckets and makes each ``.grad`` a view of its bucket. A gradient computed into a fresh
tensor (what ``zero_grad(set_to_none=True)`` leaves every step) is then copied into the
bucket and divided by the world size: one more read and write of every gradient (4.9 GB
of fp32 a step for Llama-3.2-1B). :func:`~xpuruntime.pytorch.distributed.data_parallel`
registers each parameter's bucket view here, and the weight-gradient GEMMs of our ops
(:func:`ops.fused_linear`, the joined projections, the fused loss's head) write into it:
autograd keeps that tensor as the ``.grad`` (it is the only reference), DDP finds the
gradient already in place, and the collective itself averages.

A target is taken only for a gradient that is the parameter's whole one: its ``.grad``
unset (a micro-step of gradient accumulation adds to the bucket as DDP does), the first
of this backward (a layer called twice adds its second part out of place), outside
``torch.compile``'s tracing and a backward that builds a graph (``create_graph``), and
never for a tensor of another shape or dtype.
"""

from __future__ import annotations

import torch

__all__ = ["clear_target", "gradient_target", "set_target", "targeted"]

_TARGET = "_xpuruntime_grad_target"


class _Target:
    __slots__ = ("task", "view")

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.task = -1  # the autograd graph task that last wrote into it


def set_target(parameter: torch.Tensor, view: torch.Tensor) -> None:
    """Write ``parameter``'s future gradients into ``view`` (its shape and dtype)."""
    held = parameter.__dict__.get(_TARGET)
    if held is not None and held.view.data_ptr() == view.data_ptr():
        return  # the same memory: keep its record of this backward
    parameter.__dict__[_TARGET] = _Target(view)


def clear_target(parameter: torch.Tensor) -> None:
    """Forget ``parameter``'s target (the memory it held is the owner's again)."""
    parameter.__dict__.pop(_TARGET, None)


def targeted(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` where it has a target (what a forward keeps for its backward), else
    None: a forward holds no reference to tensors without one (nor under
    ``torch.compile``, whose traced backward takes none)."""
    if torch.compiler.is_compiling():
        return None
    return tensor if _TARGET in tensor.__dict__ else None


def gradient_target(parameter: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype):
    """A fresh tensor over ``parameter``'s target for a gradient of ``shape`` and
    ``dtype`` computed now, or None where it must go to a tensor of its own (see the
    module's doc). Called from a backward."""
    held = None if parameter is None else parameter.__dict__.get(_TARGET)
    if held is None or parameter.grad is not None or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled():  # a backward with create_graph: its gradients are traced
        return None
    view = held.view
    if view.shape != shape or view.dtype != dtype:
        return None
    task = torch._C._current_graph_task_id()
    if task < 0 or task == held.task:
        return None
    held.task = task
    # A new tensor object: autograd keeps a gradient as the .grad without a copy only
    # when nothing else references it.
    return view.view(shape)

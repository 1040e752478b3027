"""The optimizer stepped bucket by bucket inside a DDP backward.

A DDP step runs the optimizer after the backward, once the last bucket is reduced:
on Llama-3.2-1B (1.24B fp32 parameters) fused AdamW reads and writes about 35 GB, some
12 ms of a 160 ms step on two H100s that nothing overlaps (BENCHMARKS.md). With a
:class:`BucketSteps` installed, DDP's communication hook all-reduces each bucket and then
steps the user's own optimizer over that bucket's parameters on a side stream that waits
for that all-reduce alone, so the update of the last layers runs while the backward of
the first ones computes. The optimizer's state, hyperparameters (a scheduler's learning
rate included) and ``state_dict`` stay the user's: each bucket's step is the optimizer's
own ``step`` over a view of its parameter groups holding that bucket's parameters.

Only optimizers whose update of a parameter reads that parameter's gradient and state
alone are stepped so (the torch.optim classes in :data:`PER_PARAMETER`); the gradients
must be used as reduced, with no clipping or loss scaling between the backward and the
step. The user's ``optimizer.step()`` then steps what the buckets did not: parameters
held back (a tied embedding whose lookup gradient is added after DDP's reductions), and
every parameter after a backward under ``no_sync``, where DDP runs no hook.
"""

from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .._errors import InvalidInputError

__all__ = ["PER_PARAMETER", "BucketSteps", "check_steppable", "stepped_in_backward"]

logger = logging.getLogger("xpuruntime.pytorch")

PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)
"""Optimizers whose update of a parameter reads only its own gradient and state."""


def check_steppable(optimizer: Any, bucket_view: bool) -> None:
    """Refuse, naming why, an optimizer a :class:`BucketSteps` cannot step."""
    if type(optimizer) not in PER_PARAMETER:
        names = ", ".join(c.__name__ for c in PER_PARAMETER)
        raise InvalidInputError(
            f"data_parallel(optimizer=...): a {type(optimizer).__name__} cannot be stepped "
            f"per bucket (only optimizers whose update of a parameter reads its own "
            f"gradient and state alone: {names}); leave optimizer out"
        )
    if stepped_in_backward(optimizer):
        raise InvalidInputError(
            "data_parallel(optimizer=...): this optimizer is stepped in another DDP "
            "module's backward already"
        )
    if not bucket_view:
        raise InvalidInputError(
            "data_parallel(optimizer=...): needs gradient_as_bucket_view=True (the step "
            "reads the reduced buckets as the gradients)"
        )


def stepped_in_backward(optimizer: Any) -> bool:
    """Whether a :class:`BucketSteps` steps ``optimizer`` inside the backward."""
    return isinstance(
        getattr(optimizer, "__dict__", {}).get("_xpuruntime_bucket_steps"), BucketSteps
    )


class BucketSteps:
    """``optimizer`` stepped per bucket of the DDP module ``ddp`` (see the module's doc).

    Parameters
    ----------
    ddp : torch.nn.parallel.DistributedDataParallel
        Before its first backward, with ``gradient_as_bucket_view`` (its gradients are
        the reduced buckets the step reads).
    optimizer : torch.optim.Optimizer
        One of :data:`PER_PARAMETER`, over parameters of ``ddp``'s module.
    held : iterable of torch.Tensor
        Parameters stepped by ``optimizer.step()`` after the backward, not in it.

    Raises
    ------
    InvalidInputError
        ``optimizer`` is not one of :data:`PER_PARAMETER`, is stepped so already, or
        ``ddp`` does not keep its gradients as bucket views.
    """

    def __init__(
        self, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, held: Iterable[torch.Tensor]
    ) -> None:
        check_steppable(optimizer, getattr(ddp, "gradient_as_bucket_view", False))
        self.optimizer = optimizer
        self._ddp = weakref.ref(ddp)
        owned = {id(p) for p in ddp.module.parameters()}
        held_ids = {id(p) for p in held}
        self._in_backward = {  # the parameters stepped in the backward
            id(p)
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in owned and id(p) not in held_ids
        }
        self._stepped: set[int] = set()  # stepped in the running (or last) backward
        self._views: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}  # a bucket's groups
        self._joining = False  # the main stream's wait for the side stream is queued
        on_gpu = next(ddp.module.parameters()).is_cuda
        self._stream = torch.cuda.Stream() if on_gpu else None
        self._bucket_step = _unhooked(type(optimizer).step)
        self._user_step = optimizer.step  # hooks and a scheduler's wrapper run here, once
        ddp.register_comm_hook(None, self._hook)
        # A method of the optimizer (a scheduler rebinds the function it wraps to it).
        optimizer.__dict__["step"] = types.MethodType(_step_what_is_left, optimizer)
        optimizer.__dict__["_xpuruntime_bucket_steps"] = self
        logger.info(
            "data_parallel: %s stepped per bucket in the backward over %d of its "
            "parameters (%d held for its step)",
            type(optimizer).__name__, len(self._in_backward), len(held_ids),
        )  # fmt: skip

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """The user's ``optimizer.step()``: the parameters with a gradient that no bucket
        stepped since the last backward began."""
        if closure is not None:
            raise InvalidInputError(
                "optimizer.step(closure): an optimizer stepped per DDP bucket takes no "
                "closure (the backward has stepped most parameters already)"
            )
        left = [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in self._stepped
        ]
        self._stepped.clear()
        self._step_over(left, self._user_step)

    def _step_over(self, params: list[torch.Tensor], step: Callable[[], Any]) -> None:
        """``step()``, the optimizer's groups holding only ``params`` meanwhile."""
        groups = self.optimizer.param_groups
        key = (len(groups), *map(id, params))
        views = self._views.get(key)
        if views is None:  # a bucket's groups, the same in every step
            chosen = set(key[1:])
            views = [
                [p for p in g["params"] if id(p) in chosen] for g in self.optimizer.param_groups
            ]
            if len(self._views) < 4096:
                self._views[key] = views
        kept = [group["params"] for group in groups]
        try:
            for group, view in zip(groups, views):
                group["params"] = view
            step()
        finally:
            for group, params_of_group in zip(groups, kept):
                group["params"] = params_of_group

    def _hook(self, state, bucket):  # unannotated: DDP checks the annotations' objects
        """DDP's communication hook (``dist.GradBucket`` -> ``Future``): the bucket
        averaged over the ranks (as DDP's own hook: divided, then summed), then its
        parameters stepped once it is."""
        ddp = self._ddp()
        group = ddp.process_group
        if not self._joining:  # this backward's first bucket
            self._stepped.clear()
            self._joining = True
            Variable._execution_engine.queue_callback(self._join)
        buffer = bucket.buffer()
        buffer.div_(group.size())
        reduced = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        params = [p for p in bucket.parameters() if id(p) in self._in_backward]
        if not params:  # held parameters alone: DDP waits for the reduction itself
            return reduced.then(lambda future: future.value()[0])
        if self._stream is None:
            reduced.wait()
            self._step_over(params, self._step_bucket)
        else:  # NCCL's stream waited for the division; this one waits for NCCL's
            with torch.cuda.stream(self._stream):
                reduced.wait()  # the host does not wait
                self._step_over(params, self._step_bucket)
        self._stepped.update(id(p) for p in params)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _step_bucket(self) -> None:
        self._bucket_step(self.optimizer)

    def _join(self) -> None:
        """At the backward's end: what follows on the main stream waits for the steps."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._joining = False


def _step_what_is_left(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    optimizer.__dict__["_xpuruntime_bucket_steps"].step(closure)


def _unhooked(step: Callable) -> Callable:
    """The optimizer class's ``step`` without the profiling wrapper torch.optim puts
    around it (its hooks run once, in the user's step, not once per bucket)."""
    return getattr(step, "__wrapped__", step)

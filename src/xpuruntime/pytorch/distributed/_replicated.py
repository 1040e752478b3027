"""Trained parameters kept whole on every rank, their gradients averaged in buckets as
the backward makes them, without DistributedDataParallel or FSDP2 holding them.

A LoRA model's trained adapters are a fraction of a percent of its parameters (42 M of
Llama-3.1-8B's 8 B at r=16). Sharded with the frozen base, each one is gathered in every
forward and its gradient reduce-scattered in every backward. FSDP2 does host work per
parameter and collective: it bounded the 8B LoRA step on two H200s, whose kernels took
about half the step. :func:`~._fsdp.shard` leaves the adapters out of FSDP2
(``ignored_params``) and installs :class:`ReplicatedGradients`. Each rank holds them
whole, and their gradients are averaged as DDP averages them.

:func:`~._ddp.data_parallel` does the same for such a model instead of wrapping it in
DDP. DDP's reducer ran the plain loop's Llama-3.2-1B LoRA step 1-2 ms slower than these
hooks: 100.8-101.4 ms against 98.9-100.1, and 97-98 on one GPU (two H200s, torch 2.11,
2026-11-30; BENCHMARKS.md).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..._errors import InvalidInputError, UnsupportedOperationError
from .._ops._infra._grad_targets import set_target

__all__ = ["REPLICATED", "REPLICATED_SHARE", "ReplicatedGradients", "keep_whole", "replicates"]

logger = logging.getLogger("xpuruntime.pytorch")

REPLICATED_SHARE = 0.05
"""The share of a model's parameters up to which :func:`~._fsdp.shard` and
:func:`~._ddp.data_parallel` keep its trained ones whole on every rank, where others are
frozen (``replicate_trained``)."""

REPLICATED = "_xpuruntime_replicated"
"""The attribute of a model holding its :class:`ReplicatedGradients`."""

BUCKET_BYTES = 25 * 2**20
"""A bucket's gradient bytes (DDP's default bucket): the last one to fill is all-reduced
after the backward, the others while it runs."""


class _Bucket:
    """Parameters of one dtype and device whose gradients are views of one buffer."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.buffer = torch.empty(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = [
            v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in params]), params)
        ]
        self.ready = 0


class ReplicatedGradients:
    """Averages the gradients of ``module``'s trained parameters over ``group`` in each
    backward.

    The parameters go into buckets in the reverse of their order (about the order the
    backward makes their gradients). Each gradient becomes a view of its bucket: our
    ops' GEMMs write it there (its gradient target), others' are copied in. A full
    bucket is all-reduced at once, in bucket order on every rank; the end of a backward
    waits for those launched. A backward run in parts (reentrant checkpointing runs one
    per layer) fills the buckets over its parts. Every trained parameter must get a
    gradient in each backward, as under DDP without ``find_unused_parameters``: the
    next forward raises where one did not. Micro-batches that FSDP2 leaves unreduced
    (``set_requires_gradient_sync(False)``) are averaged here each backward: the sum is
    the same. Installing it broadcasts the parameters from rank 0, as DDP does.
    """

    def __init__(
        self, module: torch.nn.Module, caller: str, group: dist.ProcessGroup | None = None
    ) -> None:
        self._caller = caller  # (named in the error of a parameter left out)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = {p: name for name, p in named}
        params = [p for _, p in named]
        self._group = group
        self._average = dist.get_backend(group) == "nccl"
        self._size = dist.get_world_size(group)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p, dist.get_global_rank(group, 0) if group else 0, group=group)
        self.buckets = _buckets(list(reversed(params)))
        self._where = {}
        for index, bucket in enumerate(self.buckets):
            for p, view in zip(bucket.params, bucket.views):
                self._where[p] = index
                set_target(p, view)  # where our ops' GEMMs write it
                p.register_post_accumulate_grad_hook(self._accumulated)
        self._next = 0  # the next bucket to launch, in order
        self._works: list = []
        self._queued = False
        self._seen: set[torch.Tensor] = set()  # those with a gradient in this backward
        module.register_forward_pre_hook(self._check_complete)

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        self._seen.add(param)
        self.buckets[self._where[param]].ready += 1
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):  # (each has its gradient)
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        op = dist.ReduceOp.AVG
        if not self._average:  # (gloo has no average)
            bucket.buffer.div_(self._size)
            op = dist.ReduceOp.SUM
        self._works.append(dist.all_reduce(bucket.buffer, op=op, group=self._group, async_op=True))
        self._next += 1

    def _finish(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._queued = [], False
        if self._next == len(self.buckets):  # all averaged: the next backward starts over
            self._start_over()

    def _start_over(self) -> None:
        for bucket in self.buckets:
            bucket.ready = 0
        self._next = 0
        self._seen.clear()

    def _check_complete(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._seen:
            return
        missing = [name for p, name in self._names.items() if p not in self._seen]
        self._start_over()
        raise UnsupportedOperationError(
            f"{self._caller}: {len(missing)} trained parameter(s) kept whole on every rank got no "
            f"gradient in the last backward (first: {missing[:3]}), so that backward's "
            "gradients were not all averaged over the ranks. Every trained parameter must take "
            "part in each backward; for a model where some do not, pass "
            f"replicate_trained=False to {self._caller}"
        )


def keep_whole(model: torch.nn.Module, caller: str) -> None:
    """Keep ``model``'s trained parameters whole on every rank, their gradients averaged
    by a :class:`ReplicatedGradients` held as its :data:`REPLICATED` attribute (logged)."""
    setattr(model, REPLICATED, ReplicatedGradients(model, caller))
    params = [p for p in model.parameters() if p.requires_grad]
    logger.info("%s: %d trained parameter(s) (%.1f M) kept whole on every rank, their "
                "gradients averaged in buckets", caller, len(params),
                sum(p.numel() for p in params) / 1e6)  # fmt: skip


def replicates(model: torch.nn.Module, replicate_trained: bool | None, caller: str) -> bool:
    """Whether ``caller`` keeps ``model``'s trained parameters whole on every rank: as
    ``replicate_trained`` says, or where None, where some parameters are frozen and
    the trained ones are at most :data:`REPLICATED_SHARE` of the model (a LoRA model's
    adapters)."""
    if replicate_trained not in (None, True, False):
        raise InvalidInputError(
            f"{caller}: replicate_trained must be True, False or None (chosen), got "
            f"{replicate_trained!r}"
        )
    if replicate_trained is not None:
        return replicate_trained
    total = sum(p.numel() for p in model.parameters())
    share = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 0 < share < total and share <= REPLICATED_SHARE * total


def _buckets(params: list[torch.Tensor]) -> list[_Bucket]:
    """``params`` in order, split where a bucket reaches :data:`BUCKET_BYTES` or the
    dtype or device changes."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (
            size >= BUCKET_BYTES or (p.dtype, p.device) != (current[0].dtype, current[0].device)
        ):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(_Bucket(current))
    return buckets

"""DDP's gradients computed in its buckets, and averaged by the collective.

Each step, ``DistributedDataParallel`` copies every gradient into its bucket, dividing by
the world size on the way (``zero_grad(set_to_none=True)`` leaves the ``.grad`` unset, so
autograd hands it a new tensor every step): one more read and write of all gradients,
inside the backward (4.9 GB of fp32 a step for Llama-3.2-1B). A :class:`BucketGradients`
installed as the DDP model's communication hook

- registers each parameter's view of its bucket as its gradient target
  (:mod:`._ops._infra._grad_targets`), where our ops' weight-gradient GEMMs then write, so DDP
  finds those gradients in place and copies nothing;
- averages each bucket in the all-reduce itself (NCCL's ``AVG``), since with a hook DDP
  no longer divides; gloo, which has no average, divides the bucket first;
- records the final buckets' layout, which a sharded optimizer (:mod:`._optimizer_shards`)
  lays the parameters out in; where that rebuilt the buckets in symmetric memory, each
  all-reduce runs as its reduce-scatter and a copy-engine all-gather (its ``halves``).

The views are registered once DDP has rebuilt its buckets (it does once, in the second
or third step's forward; never where it finds unused parameters without a static
graph): views of the old buckets would be written to and keep them alive. Gradients our
ops do not compute (norms, the embedding's lookup, layers left to ``F.linear``) reach
the buckets as before, copied (without the division).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .._ops._infra._grad_targets import clear_target, set_target

__all__ = ["BucketGradients"]


class BucketGradients:
    """The communication hook of ``ddp`` described in the module's doc; installing it
    registers it (a DDP model takes one hook, before its first backward)."""

    def __init__(self, ddp: torch.nn.Module) -> None:
        self._group = ddp.process_group
        self._average = dist.get_backend(self._group) == "nccl"
        self._size = dist.get_world_size(self._group)
        self._ddp = weakref.ref(ddp)  # DDP holds this hook: no cycle through us
        # Bucket index -> (its gradients, parameters, their views), once final: the
        # layout a sharded optimizer (:mod:`._optimizer_shards`) lays the parameters out in.
        self.buckets: dict[int, tuple] = {}
        # Set where the buckets were rebuilt in symmetric memory (:mod:`._optimizer_shards`):
        # what reduces each one, half on the copy engines.
        self.halves = None
        params = [p for p in ddp.parameters() if p.requires_grad]
        # The views hold the buckets' memory: forgotten with the wrapper.
        weakref.finalize(ddp, _forget, params)
        ddp.register_comm_hook(None, self._reduce)

    # Unannotated: DDP checks a hook's annotations as objects, and this module's are
    # strings. ``bucket`` is a ``dist.GradBucket``; the future gives its reduced buffer.
    def _reduce(self, state, bucket):
        buffer, index = bucket.buffer(), bucket.index()
        if index not in self.buckets and _buckets_final(self._ddp()):  # once: they stay
            params, views = bucket.parameters(), bucket.gradients()
            for parameter, view in zip(params, views):
                set_target(parameter, view)
            self.buckets[index] = (buffer, params, views)
        if index in self.buckets and self.halves is not None:
            return self.halves.all_reduce(index, buffer, self._group)
        op = dist.ReduceOp.AVG
        if not self._average:
            buffer.div_(self._size)
            op = dist.ReduceOp.SUM
        work = dist.all_reduce(buffer, op=op, group=self._group, async_op=True)
        return work.get_future().then(lambda done: done.value()[0])


def _forget(params: list[torch.Tensor]) -> None:
    for parameter in params:
        clear_target(parameter)


def _buckets_final(ddp: torch.nn.Module | None) -> bool:
    """Whether ``ddp``'s buckets stay as they are: rebuilt, or never to be (DDP rebuilds
    unless it looks for unused parameters without a static graph)."""
    if ddp is None:
        return False
    never = ddp.find_unused_parameters and not ddp.static_graph
    return never or getattr(ddp, "_has_rebuilt_buckets", False)

"""The kernel policy in a torch.distributed job: one policy on every rank, one kernel
per op on every rank, and the dispatch logs of all ranks in one place.

The seed documents give the training module one distributed duty, an NCCL helper;
everything else is PyTorch's own (``torchrun``, DDP, FSDP2). So this module starts the
process group from the ``torchrun`` environment, and then holds the policy to the
job's terms:

- :func:`set_kernel_policy` and :func:`make_train_step`, called with a process group
  up, compare the policy's fingerprint across ranks; a mismatch is a
  :class:`~xpuruntime.PolicyError` on every rank, naming the ranks and the keys that
  differ (ranks that ran different kernels would still train, just not the same model).
- Kernels chosen by ``best_performance`` are rank 0's: each rank measures, then all
  take rank 0's result (a broadcast), so no op runs two kernels in one job.
- Dispatch records carry the rank; :func:`gather_dispatch_logs` brings them to rank 0.

Run under ``torchrun``::

    xpt.distributed.init_distributed()          # NCCL on CUDA, gloo on the CPU
    xpt.set_kernel_policy("policy.yaml")         # checked against every rank's
    model = DDP(model)
    ...
    logs = xpt.distributed.gather_dispatch_logs()  # on rank 0: every rank's records
"""

from ._ddp import BUCKETS, bucket_size, data_parallel
from ._fsdp import KEEP_GATHERED, shard
from ._ranks import (
    barrier,
    check_policy,
    compare_ranks,
    gather_dispatch_logs,
    init_distributed,
    is_initialized,
    rank,
    world_size,
)
from ._replicated import REPLICATED_SHARE
from ._zero import shard_optimizer, wait_for_parameters

__all__ = [
    "BUCKETS",
    "KEEP_GATHERED",
    "REPLICATED_SHARE",
    "barrier",
    "bucket_size",
    "check_policy",
    "compare_ranks",
    "data_parallel",
    "gather_dispatch_logs",
    "init_distributed",
    "is_initialized",
    "rank",
    "shard",
    "shard_optimizer",
    "wait_for_parameters",
    "world_size",
]

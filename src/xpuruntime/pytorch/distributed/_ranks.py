"""The job's ranks: the process group started from ``torchrun``'s environment, one
policy on every rank, rank 0's measured choices, the dispatch logs of all ranks in one
place. What the layers below ``distributed`` may use (lazily), and the names of the
attributes the wrappers leave on models and optimizers for them."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..._errors import InvalidInputError, PolicyError, XpuRuntimeError
from ...kernels import DispatchRecord, dispatcher
from ...policies import KernelPolicy

__all__ = [
    "BUCKET_GRADIENTS",
    "CAPTURABLE",
    "OPTIMIZER_SHARDS",
    "SIDE_STREAM",
    "barrier",
    "check_policy",
    "compare_ranks",
    "gather_dispatch_logs",
    "init_distributed",
    "is_initialized",
    "last_comparison",
    "rank",
    "world_size",
]

logger = logging.getLogger("xpuruntime.pytorch")


# The attributes the wrappers leave for the training step (the layers below read them by
# these names): a DDP model's side stream and that it can be captured, its bucket
# gradients, an optimizer's shards.
SIDE_STREAM = "_xpuruntime_stream"
CAPTURABLE = "_xpuruntime_capturable"
BUCKET_GRADIENTS = "_xpuruntime_buckets"
OPTIMIZER_SHARDS = "_xpuruntime_shards"


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def init_distributed(
    backend: str | None = None, timeout: datetime.timedelta | float = _DEFAULT_TIMEOUT
) -> None:
    """Start the process group from the ``torchrun`` environment.

    Parameters
    ----------
    backend : {'nccl', 'gloo'}, optional
        Default: NCCL when CUDA is available, else gloo. With NCCL the process's CUDA
        device is set from ``LOCAL_RANK``, and NVLink multicast stays off
        (``NCCL_NVLS_ENABLE=0``) unless the environment says otherwise.
    timeout : timedelta or seconds
        How long collectives may wait for another rank before failing.

    Raises
    ------
    InvalidInputError
        The environment lacks what ``torchrun`` sets (the message lists it), or a
        value is malformed.
    XpuRuntimeError
        The process group could not start (the backend's exception chained).
    """
    if dist.is_initialized():
        return
    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise InvalidInputError(
            f"init_distributed: the environment lacks {missing}; start the processes with "
            "torchrun (e.g. torchrun --nproc_per_node 2 train.py), which sets "
            f"{list(_TORCHRUN_ENV)}"
        )
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as e:
        raise InvalidInputError(f"init_distributed: a torchrun variable is not an int: {e}") from e
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise InvalidInputError(
            f"init_distributed: backend must be 'nccl' or 'gloo', got {backend!r}"
        )
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    options: dict[str, Any] = {}
    if backend == "nccl":
        # Multicast objects (NVLS) are not released reliably on the lent machines, and
        # the job does not need them: off unless asked for.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local_rank)
        options["device_id"] = torch.device("cuda", local_rank)
    try:
        dist.init_process_group(backend, timeout=timeout, **options)
    except Exception as e:
        raise XpuRuntimeError(f"init_distributed: {backend} could not start: {e}") from e
    dispatcher.log.rank = dist.get_rank()
    dispatcher.consensus = _rank0_choice
    logger.info("process group up: rank %d of %d (%s)", rank(), world_size(), backend)


def is_initialized() -> bool:
    """Whether a torch.distributed process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 outside a distributed job)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """How many processes the job has (1 outside a distributed job)."""
    return dist.get_world_size() if is_initialized() else 1


def barrier(timeout: datetime.timedelta | float | None = None) -> None:
    """Wait until every rank arrives; with gloo and a ``timeout``, a rank that does not
    arrive in time is named in the error instead of hanging the job."""
    if not is_initialized():
        return
    if timeout is not None and dist.get_backend() == "gloo":
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        try:
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise XpuRuntimeError(f"barrier: {e}") from e
        return
    dist.barrier()


def check_policy(policy: KernelPolicy | None) -> None:
    """Raise on every rank unless every rank holds the same policy (no-op outside a
    distributed job). Every rank raises at the same point: a program that catches the
    error and ends the job should not free a ``DistributedDataParallel`` model and its
    gloo process group on the way out (torch's gloo group can deadlock there: its
    destructor joins a worker thread while holding the GIL that thread waits for);
    ``examples/train_ddp.py`` passes a ``barrier()`` and exits the process.

    Raises
    ------
    PolicyError
        Names the ranks whose policy differs from rank 0's, and the keys that differ.
    """
    if not is_initialized():
        return
    mine = None if policy is None else policy.to_dict()
    fingerprint = None if policy is None else policy.fingerprint()
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, (fingerprint, mine))
    reference_fp, reference = gathered[0]
    differing = {}
    for other, (fp, data) in enumerate(gathered):
        if fp != reference_fp:
            differing[other] = _differing_keys(reference, data)
    if differing:
        detail = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in differing.items())
        raise PolicyError(
            f"the kernel policy differs between ranks (against rank 0's, fingerprint "
            f"{reference_fp}): {detail}. Every rank must run the same policy"
        )


def gather_dispatch_logs(dst: int = 0) -> list[DispatchRecord] | None:
    """Every rank's dispatch records, on rank ``dst`` (None on the other ranks); this
    process's own records outside a distributed job. Each record carries its rank."""
    records = dispatcher.log.records
    if not is_initialized():
        return records
    gathered: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if gathered is None:
        return None
    merged = [record for per_rank in gathered for record in per_rank]
    global last_comparison
    last_comparison = compare_ranks(merged)
    return merged


last_comparison: str | None = None
"""What :func:`gather_dispatch_logs` last found about the ranks' kernel choices (on the
rank that gathered); :func:`~xpuruntime.pytorch.explain_kernel_policy` shows it."""


def compare_ranks(records: list[DispatchRecord]) -> str:
    """Whether the ranks in ``records`` chose the same kernels for each op, and where
    they did not."""
    chosen: dict[str, dict[int | None, set[str]]] = {}
    for record in records:
        chosen.setdefault(record.op, {}).setdefault(record.rank, set()).add(record.chosen)
    ranks = sorted({r.rank for r in records if r.rank is not None})
    differing = [
        f"{op}: " + ", ".join(f"rank {r} {'/'.join(sorted(k))}" for r, k in sorted(per.items()))
        for op, per in sorted(chosen.items())
        if len({frozenset(k) for k in per.values()}) > 1
    ]
    if differing:
        return "the ranks chose different kernels: " + "; ".join(differing)
    return f"ranks {ranks} chose the same kernels for every op in their logs"


def _rank0_choice(op: str, found: tuple) -> tuple:
    """The dispatcher's consensus hook: rank 0's ``best_performance`` result."""
    box = [found if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    chosen, reason, timings = box[0]
    if rank() != 0:
        reason = f"{reason} (measured on rank 0; this rank measured {found[0]!r})"
    return chosen, reason, timings


def _differing_keys(reference: dict[str, Any] | None, other: dict[str, Any] | None) -> list[str]:
    if reference is None or other is None:
        return ["no policy" if other is None else "a policy where rank 0 has none"]
    keys = []
    for key in sorted(set(reference) | set(other)):
        if key == "kernels":
            ops = set(reference[key]) | set(other[key])
            keys += [
                f"{op}={other[key].get(op)!r} (rank 0: {reference[key].get(op)!r})"
                for op in sorted(ops)
                if reference[key].get(op) != other[key].get(op)
            ]
        elif reference.get(key) != other.get(key):
            keys.append(f"{key}={other.get(key)!r} (rank 0: {reference.get(key)!r})")
    return keys

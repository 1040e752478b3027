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

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from .._errors import InvalidInputError, PolicyError, XpuRuntimeError
from ..kernels import DispatchRecord, dispatcher
from ..policies import KernelPolicy
from ._bucket_gradients import BucketGradients
from ._embedding_rows import RowsExchange, tied_embeddings
from ._optimizer_shards import OptimizerShards, check_shardable

__all__ = [
    "barrier",
    "bucket_size",
    "check_policy",
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

logger = logging.getLogger("xpuruntime.pytorch")

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


def data_parallel(
    model: torch.nn.Module,
    *,
    embedding_rows: bool = True,
    gradients_in_buckets: bool = True,
    **options: Any,
) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` as a graphed training step needs it, its tied
    embedding's gradient exchanged as rows, its layers' weight gradients computed in its
    buckets.

    ``static_graph`` and ``gradient_as_bucket_view`` are on unless ``options`` say
    otherwise (the gradients are the all-reduce's buckets, one copy fewer), the device
    is this process's GPU, and the wrapper is built on a side stream, on which a graphed
    step then warms up and captures: PyTorch captures DDP's backward only so, since the
    gradient accumulators it holds run on the stream they were made on.
    :func:`~xpuruntime.pytorch.make_train_step` with ``cuda_graph`` refuses a DDP
    model built otherwise.

    Parameters
    ----------
    model : torch.nn.Module
        Optimized first (:func:`~xpuruntime.pytorch.optimize`), on this rank's device.
    embedding_rows : bool
        An input embedding whose weight the LM head shares gets that weight's gradient
        last, from its lookup, so DDP would all-reduce the whole V x H gradient after the
        backward, exposed (1 GB for Llama-3.2-1B). On (the default), the lookup's part is
        gathered as one row per token from every rank and added after DDP's reduction of
        the head's part, which overlaps the backward. The sum is the same up to the order
        of its terms. Embeddings not tied, sparse or renormed stay DDP's alone.
    gradients_in_buckets : bool
        On (the default), the weight-gradient GEMMs of the layers :func:`optimize` routed
        write into DDP's buckets, and the all-reduce averages (NCCL's ``AVG``), so DDP
        neither copies nor divides those gradients (one read and write of each fewer a
        step); installed as the model's communication hook (:mod:`._bucket_gradients`).
        Off for a hook of your own (DDP takes one). The average is DDP's: NCCL scales
        each rank's part by 1/N as DDP's division did.
    **options
        Passed on to ``DistributedDataParallel``. ``bucket_cap_mb`` unless given: a
        twelfth of the trained parameters' gradient bytes, from DDP's 25 MB up to 400
        (:func:`bucket_size`; logged).

    Raises
    ------
    InvalidInputError
        No process group is up (:func:`init_distributed` first).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not is_initialized():
        raise InvalidInputError(
            "data_parallel: no process group is up; call init_distributed() first (under torchrun)"
        )
    options = {"static_graph": True, "gradient_as_bucket_view": True, **options}
    if "bucket_cap_mb" not in options:
        options["bucket_cap_mb"] = bucket_size(model)
        logger.info("data_parallel: buckets of %d MB", options["bucket_cap_mb"])
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        options.setdefault("device_ids", [torch.cuda.current_device()])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapped = DistributedDataParallel(model, **options)
        torch.cuda.current_stream().wait_stream(side)
        wrapped._xpuruntime_stream = side  # where a graphed step warms up and captures
    else:
        wrapped = DistributedDataParallel(model, **options)
    wrapped._xpuruntime_capturable = True
    if gradients_in_buckets and options["gradient_as_bucket_view"]:
        wrapped._xpuruntime_buckets = BucketGradients(wrapped)
    if embedding_rows:
        for path, embedding in tied_embeddings(model):
            RowsExchange(embedding, wrapped)
            logger.info("data_parallel: %s's lookup gradient exchanged as rows", path or "model")
    return wrapped


def shard_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    copy_engines: bool | None = None,
) -> torch.optim.Optimizer:
    """``optimizer`` stepping only this rank's share of ``model``'s parameters, the rest
    gathered from the other ranks beside the next forward (ZeRO's first stage over DDP's
    buckets, :mod:`._optimizer_shards`).

    Each rank steps 1/N of every DDP bucket and keeps 1/N of the optimizer's state; the
    updated parameters are all-gathered asynchronously after the step, and each module
    of the forward waits for the buckets it holds. DDP's contract stays: gradients are
    all-reduced, so every ``.grad`` holds the average until the step (clip or log them as
    before), and the result is the unsharded step's, bit for bit. The buckets the forward
    needs first are stepped whole on every rank (their gathers would delay the forward's
    start; stepping them costs less). The split begins at the first step after DDP has
    rebuilt its buckets (the second or third); the steps before are whole, as under DDP.
    After each step the model's gradients are released (``zero_grad(set_to_none=True)``).
    Parameters read outside the forward right after a step (an EMA copy) need
    :func:`wait_for_parameters` first; the model's ``state_dict`` waits by itself. The
    optimizer's ``state_dict()`` is the unsharded optimizer's, gathered (call it on every
    rank), and an unsharded one's loads.

    Parameters
    ----------
    model : torch.nn.Module
        From :func:`data_parallel` with ``gradients_in_buckets`` on (its bucket layout is
        what is split).
    optimizer : torch.optim.Optimizer
        Over ``model``'s parameters: SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop or
        Adagrad (each element stepped from its own gradient and state alone), parameters
        contiguous. Not under ``GradScaler`` nor in a CUDA-graph step.
    copy_engines : bool, optional
        Whether the gathers run on the GPUs' copy engines (NCCL's zero-CTA all-gather over
        symmetric memory), taking no SM from the forward they overlap; DDP's buckets then
        move to symmetric memory too, and each all-reduce runs as a reduce-scatter on
        NCCL's kernels and an all-gather on the copy engines. None (the default): where
        this torch and NCCL can, else on NCCL's kernels (logged); True: there or an error.

    Returns
    -------
    torch.optim.Optimizer
        ``optimizer`` itself, hooked (its schedulers keep working).

    Raises
    ------
    InvalidInputError
        ``model`` is not :func:`data_parallel`'s with its gradients in the buckets, the
        optimizer is not one of the above or holds tensors that are not the model's, it
        is sharded already, or ``copy_engines=True`` without CUDA. Later, from the
        optimizer's ``step``: ``GradScaler``'s fused step; from a graphed train step: the
        sharded optimizer.
    XpuRuntimeError
        ``copy_engines=True`` where NCCL's copy-engine all-gather is not available.

    Examples
    --------
    >>> model = xpt.distributed.data_parallel(xpt.optimize(model))  # doctest: +SKIP
    >>> opt = xpt.distributed.shard_optimizer(model, torch.optim.AdamW(model.parameters()))
    """
    buckets = getattr(model, "_xpuruntime_buckets", None)
    if buckets is None:
        raise InvalidInputError(
            "shard_optimizer: model must come from data_parallel(...) with "
            f"gradients_in_buckets on (its bucket layout is what is split), got {type(model).__name__}"
        )
    if getattr(optimizer, "_xpuruntime_shards", None) is not None:
        raise InvalidInputError("shard_optimizer: this optimizer is sharded already")
    check_shardable(model, optimizer)
    optimizer._xpuruntime_shards = OptimizerShards(model, optimizer, buckets, copy_engines)
    return optimizer


def wait_for_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Make the current stream wait for the parameters' all-gathers that the last step of
    an optimizer from :func:`shard_optimizer` started (nothing to wait for otherwise):
    before reading the parameters outside the model's forward right after a step (an EMA
    copy, a checksum). The next forward, the model's ``state_dict`` and the next step
    wait by themselves.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Any; only one from :func:`shard_optimizer` has gathers in flight.
    """
    shards = getattr(optimizer, "_xpuruntime_shards", None)
    if shards is not None:
        shards.wait()


BUCKETS = 12
"""How many buckets :func:`bucket_size` aims at: Llama-3.2-1B's 4.9 GB of fp32 gradients
in buckets of 400 MB instead of DDP's 25 ran 151.2 ms a step against 153.7 on two
H100s, 154.5 against 158.1 on four (BENCHMARKS.md): fewer, larger all-reduces, the
last one still small beside the backward."""


def bucket_size(model: torch.nn.Module) -> int:
    """DDP's ``bucket_cap_mb`` for ``model`` in :func:`data_parallel`: its trained
    parameters' gradient bytes over :data:`BUCKETS`, in MB, within DDP's default of 25 and
    400 (a small model keeps DDP's buckets, so that its all-reduces still overlap its
    backward)."""
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return int(min(400, max(25, trained / BUCKETS / 2**20)))


_PRECISIONS = ("bf16", "fp32")


def shard(
    model: torch.nn.Module,
    *,
    precision: str = "bf16",
    blocks: list[torch.nn.Module] | None = None,
    reshard_after_forward: bool | None = None,
) -> torch.nn.Module:
    """FSDP2 over ``model``: ``fully_shard`` on each of its repeated blocks (a
    transformer's decoder layers), then on the model.

    With ``precision='bf16'`` the parameters are gathered and computed in bf16 and the
    gradients reduced in fp32 (FSDP2's ``MixedPrecisionPolicy``, as torchtitan trains):
    gathering fp32 weights bounds the step of an 8B model (BENCHMARKS.md, 4 H100s: the
    full fine-tune 1.16x torch.compile this way, 0.96x with fp32 gathers).

    Parameters
    ----------
    model : torch.nn.Module
        Optimized first (:func:`~xpuruntime.pytorch.optimize`); build the optimizer after
        sharding (FSDP2 swaps the parameters).
    precision : {'bf16', 'fp32'}
        What the gathered parameters are computed in ('fp32': their own dtype).
    blocks : list of torch.nn.Module, optional
        The units to shard one by one. Default: the children of the model's largest
        ``nn.ModuleList`` whose children are all of one class (Llama's
        ``model.layers``).
    reshard_after_forward : bool, optional
        Free each block's gathered parameters after its forward (gathered again for the
        backward): less memory, one more all-gather per block. None (the default):
        kept gathered where all the blocks' gathered parameters take at most
        ``KEEP_GATHERED`` of the GPU's memory, as ZeRO-2 keeps them (Llama-3.2-1B on two
        H100s: 0.98x one GPU's per-GPU throughput kept, 0.93x resharded; BENCHMARKS.md),
        resharded otherwise and on the CPU; the log says which and why.

    Returns
    -------
    torch.nn.Module
        ``model``, sharded in place.

    Raises
    ------
    InvalidInputError
        No process group is up, ``precision`` or ``reshard_after_forward`` is not one
        of the above, or the model has no repeated blocks and none were given.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if reshard_after_forward not in (None, True, False):
        raise InvalidInputError(
            f"shard: reshard_after_forward must be True, False or None (chosen), got "
            f"{reshard_after_forward!r}"
        )
    if not is_initialized():
        raise InvalidInputError(
            "shard: no process group is up; call init_distributed() first (under torchrun)"
        )
    if precision not in _PRECISIONS:
        raise InvalidInputError(f"shard: precision must be one of {_PRECISIONS}, got {precision!r}")
    if blocks is None:
        blocks = _repeated_blocks(model)
        if not blocks:
            raise InvalidInputError(
                f"shard: {type(model).__name__} has no nn.ModuleList of blocks of one "
                "class; pass blocks=[...] (the modules to shard one by one)"
            )
    elif not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
        raise InvalidInputError(
            f"shard: blocks must be a non-empty list of modules, got {blocks!r}"
        )
    mixed = MixedPrecisionPolicy()  # the parameters' own dtype
    if precision == "bf16":
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if reshard_after_forward is None:
        reshard_after_forward = _reshard_after_forward(blocks, mixed.param_dtype)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    logger.info("shard: %d %s block(s) and the model, computed in %s",
                len(blocks), type(blocks[0]).__name__, precision)  # fmt: skip
    return model


KEEP_GATHERED = 0.08
"""The share of a GPU's memory up to which :func:`shard` keeps the blocks' gathered
parameters from the forward to the backward (Llama-3.2-1B's decoder layers in bf16 take
about 2% of an 80 GB H100: kept; Llama-3.1-8B's about 17%: resharded)."""


def _reshard_after_forward(blocks: list[torch.nn.Module], dtype: torch.dtype | None) -> bool:
    """Whether :func:`shard` frees each block's gathered parameters after its forward:
    unless they all fit in ``KEEP_GATHERED`` of this rank's GPU (logged either way)."""
    params = [p for block in blocks for p in block.parameters()]
    gathered = sum(p.numel() * (dtype or p.dtype).itemsize for p in params)
    if not params or not params[0].is_cuda:
        logger.info("shard: blocks resharded after the forward (not on a GPU)")
        return True
    memory = torch.cuda.get_device_properties(params[0].device).total_memory
    keep = gathered <= KEEP_GATHERED * memory
    logger.info(
        "shard: blocks %s after the forward: their gathered parameters take %.1f GB, "
        "%.0f%% of the GPU's %.0f GB (kept up to %.0f%%)",
        "kept gathered" if keep else "resharded", gathered / 1e9, 100 * gathered / memory,
        memory / 1e9, 100 * KEEP_GATHERED,
    )  # fmt: skip
    return not keep


def _repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of ``model``'s largest ``nn.ModuleList`` (by parameter count) whose
    children all share one class."""
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = list(module), size
    return best


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

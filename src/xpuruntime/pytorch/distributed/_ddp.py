"""``data_parallel``: DistributedDataParallel as a graphed step can capture it, the
gradients computed in its buckets (:mod:`._bucket_gradients`) and a tied embedding's
lookup gradient exchanged as rows (:mod:`._embedding_rows`); for a model that trains a
small share of its parameters (LoRA), those kept whole and averaged without DDP
(:mod:`._replicated`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..._errors import InvalidInputError
from ._bucket_gradients import BucketGradients
from ._embedding_rows import RowsExchange, tied_embeddings
from ._ranks import BUCKET_GRADIENTS, CAPTURABLE, SIDE_STREAM, is_initialized
from ._replicated import REPLICATED, keep_whole, replicates

__all__ = [
    "BUCKETS",
    "bucket_size",
    "data_parallel",
    "state_buffers",
]

logger = logging.getLogger("xpuruntime.pytorch")


def data_parallel(
    model: torch.nn.Module,
    *,
    replicate_trained: bool | None = None,
    embedding_rows: bool = True,
    gradients_in_buckets: bool = True,
    **options: Any,
) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` as a graphed training step needs it, its tied
    embedding's gradient exchanged as rows, its layers' weight gradients computed in its
    buckets; or, for a model training a small share of its parameters (LoRA), ``model``
    itself, its trained parameters' gradients averaged over the ranks in each backward.

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
    replicate_trained : bool, optional
        Return ``model`` unwrapped, its trained parameters' gradients averaged in
        buckets of 25 MB as the backward makes them, by hooks of ours
        (:mod:`._replicated`), not by DDP's reducer. That reducer ran a plain loop's
        LoRA step 0.95-0.97x one GPU's per GPU on two H200s, these hooks 0.98x
        (BENCHMARKS.md). As under DDP, the parameters are broadcast from rank 0 first,
        and each backward must give every trained parameter a gradient: the next forward
        raises ``UnsupportedOperationError`` naming any that got none. Gradient
        accumulation averages each micro-batch (the same sum; ``no_sync`` is DDP's
        alone). None (the default): where some parameters are frozen, the trained ones
        are at most ``REPLICATED_SHARE`` of the model, the model holds no buffers that
        are state, and no DDP ``options`` are given. The other arguments are DDP's.
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
        (:func:`bucket_size`; logged). ``broadcast_buffers`` unless given: on only where
        the model holds buffers that are state (:func:`state_buffers`, as BatchNorm's
        running statistics). Buffers out of the ``state_dict``, such as a rotary
        embedding's frequencies, are made alike on every rank. Broadcasting them walked
        every module and held the ranks together at each forward's start.

    Returns
    -------
    torch.nn.Module
        The DDP wrapper, or ``model`` itself where its trained parameters are kept whole
        (``replicate_trained``).

    Raises
    ------
    InvalidInputError
        No process group is up (:func:`init_distributed` first), ``replicate_trained``
        is not True, False or None, or it is True with DDP ``options`` or buffers that
        are state (which DDP would broadcast), or ``model`` has its trained parameters
        kept whole already.
    """
    from torch.nn.parallel import DistributedDataParallel

    replicate = replicates(model, replicate_trained, "data_parallel")
    if not is_initialized():
        raise InvalidInputError(
            "data_parallel: no process group is up; call init_distributed() first (under torchrun)"
        )
    if getattr(model, REPLICATED, None) is not None:
        raise InvalidInputError(
            "data_parallel: this model's trained parameters are kept whole on every rank "
            "already (an earlier data_parallel or shard), and their gradients averaged; "
            "spreading it again would average them twice. Use the model as it is"
        )
    state = state_buffers(model)
    if replicate and (options or state):
        if replicate_trained:
            raise InvalidInputError(
                "data_parallel: replicate_trained=True keeps the model out of DDP, so DDP's "
                f"options {sorted(options)} and the broadcast of its state buffers "
                f"{state[:3]} would not apply; pass neither, or replicate_trained=False"
            )
        replicate = False  # (chosen: DDP, as the options or the buffers ask)
    if replicate:
        keep_whole(model, "data_parallel")
        return model
    options = {"static_graph": True, "gradient_as_bucket_view": True, **options}
    if "broadcast_buffers" not in options:
        options["broadcast_buffers"] = bool(state)
        logger.info("data_parallel: buffers broadcast before each forward: %s", state or "none")
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
        setattr(wrapped, SIDE_STREAM, side)  # where a graphed step warms up and captures
    else:
        wrapped = DistributedDataParallel(model, **options)
    setattr(wrapped, CAPTURABLE, True)
    if gradients_in_buckets and options["gradient_as_bucket_view"]:
        setattr(wrapped, BUCKET_GRADIENTS, BucketGradients(wrapped))
    if embedding_rows:
        for path, embedding in tied_embeddings(model):
            RowsExchange(embedding, wrapped)
            logger.info("data_parallel: %s's lookup gradient exchanged as rows", path or "model")
    return wrapped


def state_buffers(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s persistent buffers (in its ``state_dict``: state that
    training may change, which DDP broadcasts from rank 0 before each forward)."""
    return [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]


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

"""A tied embedding's lookup gradient, exchanged as rows in a DDP step.

In DDP a tied input embedding (its weight also the LM head's) gets its gradient twice:
from the head's GEMM, first in the backward, and from the lookup, the backward's last
kernel. DDP reduces a parameter once both have run, so the whole V x H gradient (1 GB of
fp32 for Llama-3.2-1B) is all-reduced after the backward, where nothing hides it: about
7 ms of a 164 ms step on two H100s (BENCHMARKS.md).

With a :class:`RowsExchange` installed the lookup reads the weight detached: the
parameter's autograd gradient is the head's alone, which DDP reduces while the backward
runs. The lookup's gradient is one row per token, ``dW[id] += dY[token]``: every rank's
(id, row) pairs are gathered (N x B x T rows: 64 MB a rank at B4 x T2048 x 2048 in fp32,
against the dense 1 GB) and added to the reduced gradient, divided by the world size as
DDP averages, once DDP has finished its reductions (an autograd engine callback queued
behind DDP's own). The sum is DDP's; only the order of its terms differs.

The ranks must send equally many rows: each forward gathers the ranks' token counts (a
few bytes, read by the backward through pinned memory, without a stream sync), and each
rank pads its rows with zeros to the largest count. A CUDA graph's capture uses the
counts of the last step before it (a graph's shapes are fixed). Under DDP's ``no_sync``
the rows are added locally and reduced with the rest at the synchronising step. Under
torch.compile the lookup runs as written (the parameter is then reduced whole, by DDP).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable
from torch.overrides import TorchFunctionMode

from ..._errors import XpuRuntimeError
from .._ops._infra._first_order import first_order

__all__ = ["RowsExchange", "tied_embeddings"]

logger = logging.getLogger("xpuruntime.pytorch")


def tied_embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """The ``nn.Embedding`` modules of ``model`` whose trained weight another module holds
    too (a tied LM head) and whose lookup a :class:`RowsExchange` can take: dense, without
    ``max_norm`` (which writes the weight) or ``scale_grad_by_freq``."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or holders.get(id(module.weight), 0) < 2:
            continue
        if not module.weight.requires_grad:
            continue
        if module.sparse or module.max_norm is not None or module.scale_grad_by_freq:
            logger.info("%s: tied, but its lookup is sparse, renormed or frequency-scaled: "
                        "reduced whole by DDP", path)  # fmt: skip
            continue
        found.append((path, module))
    return found


class RowsExchange:
    """The lookup of ``embedding`` (inside the DDP module ``ddp``), its gradient gathered
    as rows (see the module's doc). Installing replaces the embedding's forward on the
    instance; :meth:`remove` puts it back."""

    def __init__(self, embedding: nn.Embedding, ddp: nn.Module) -> None:
        self.embedding = embedding
        self._ddp = weakref.ref(ddp)  # the wrapper holds the model: no cycle through us
        # A leaf that gives the detached lookup a node in the backward.
        self._anchor = torch.zeros((), device=embedding.weight.device, requires_grad=True)
        self._counts: list[int] | None = None  # the ranks' token counts, last uncaptured step
        embedding.__dict__["forward"] = self._forward

    def remove(self) -> None:
        """Put the embedding's own forward back."""
        self.embedding.__dict__.pop("forward", None)

    def _forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        own = type(self.embedding).forward  # a subclass's too (Gemma's scaled lookup)
        if torch.compiler.is_compiling():
            return own(self.embedding, *args, **kwargs)
        with _Intercept(self):
            return own(self.embedding, *args, **kwargs)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight, padding_idx)``, its weight gradient exchanged as rows
        when this forward is DDP's and will be differentiated."""
        embedding, ddp = self.embedding, self._ddp()
        weight = embedding.weight
        if ddp is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return F.embedding(ids, weight, embedding.padding_idx)
        counts = None  # under no_sync: the rows stay local
        if ddp.require_backward_grad_sync:
            counts = self._send_count(ids.numel(), ddp.process_group)
        return _Lookup.apply(self._anchor, ids, weight.detach(), self, counts)

    def _send_count(self, count: int, group: Any) -> _Counts:
        """Every rank's token count of this lookup, on its way to the host."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if self._counts is None or self._counts[dist.get_rank(group)] != count:
                raise XpuRuntimeError(
                    f"embedding rows: a CUDA graph captures a lookup of {count} tokens, "
                    f"but the step before it had {self._counts}; capture after a step of "
                    "the captured shape"
                )
            return _Counts(torch.tensor(self._counts), None)
        device = self.embedding.weight.device
        mine = torch.full((1,), count, dtype=torch.int64, device=device)
        every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=group)
        if device.type != "cuda":
            return _Counts(every, None)
        host = torch.empty(every.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(every, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        return _Counts(host, arrived)

    def send(self, ids: torch.Tensor, rows: torch.Tensor, counts: _Counts | None) -> None:
        """From the lookup's backward: ``rows`` (one per id in ``ids``) on their way into
        the weight's gradient, after DDP's reductions."""
        padding = self.embedding.padding_idx
        if padding is not None:  # F.embedding's gradient skips the padding row
            rows = rows.masked_fill((ids == padding).unsqueeze(1), 0)
        if counts is None:  # no_sync: local, reduced at the synchronising step
            _after_ddp(lambda: self._add(ids, rows, 1.0))
            return
        ddp = self._ddp()
        if counts.arrived is not None:
            counts.arrived.synchronize()  # long done by the backward: no wait in practice
        counts = self._counts = counts.host.tolist()
        most, count = max(counts), ids.numel()
        if count < most:  # zero rows at id 0 add nothing
            ids, rows = F.pad(ids, (0, most - count)), F.pad(rows, (0, 0, 0, most - count))
        every_id = ids.new_empty(len(counts) * most)
        every_row = rows.new_empty(len(counts) * most, rows.shape[1])
        group = ddp.process_group
        works = [
            dist.all_gather_into_tensor(every_id, ids.contiguous(), group=group, async_op=True),
            dist.all_gather_into_tensor(every_row, rows.contiguous(), group=group, async_op=True),
        ]

        def add() -> None:
            for work in works:
                work.wait()
            self._add(every_id, every_row, 1.0 / len(counts))

        _after_ddp(add)

    def _add(self, ids: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
        weight = self.embedding.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype), alpha=scale)


class _Counts(NamedTuple):
    host: torch.Tensor  # every rank's count, in rank order (CPU)
    arrived: Any  # a CUDA event recorded after the copy to ``host``, or None


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, ids, weight, exchange, counts):  # weight: detached
        ctx.save_for_backward(ids)
        ctx.exchange, ctx.counts = exchange, counts
        return F.embedding(ids, weight, exchange.embedding.padding_idx)

    @staticmethod
    @first_order("the sharded embedding's row exchange")
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.exchange.send(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), ctx.counts)
        return None, None, None, None, None


class _Intercept(TorchFunctionMode):
    """Within the embedding's forward: its ``F.embedding`` call goes to the exchange."""

    def __init__(self, exchange: RowsExchange) -> None:
        super().__init__()
        self.exchange = exchange

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) > 1 and args[1] is self.exchange.embedding.weight:
            return self.exchange.lookup(args[0])
        return func(*args, **kwargs)


def _after_ddp(work: Callable[[], None]) -> None:
    """Run ``work`` when the backward ends, after every callback queued during it (DDP
    queues its reductions' finish when its last bucket is ready, which may come after
    this lookup's backward): queued from a callback, it runs behind them."""
    engine = Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(work))

"""The optimizer's state and step split over a DDP job's ranks (ZeRO-1), each step's
updated parameters gathered back beside the next forward.

Under DDP every rank steps the optimizer over every parameter, on the same averaged
gradients, to the same result: AdamW over Llama-3.2-1B's 1.24B fp32 parameters reads and
writes about 35 GB a step (some 12 ms on an H100) on each rank alike. An
:class:`OptimizerShards` hooked on the user's optimizer has each rank step only its
1/N of every DDP bucket and all-gather the updated parameters, as ZeRO's first stage
does, while keeping DDP's contract: the gradients are still all-reduced, so every
``.grad`` holds the average until the step, and clipping or logging them is as before.

- The layout is DDP's own: once DDP has rebuilt its buckets, each bucket's parameters
  are moved into one flat buffer laid out as the bucket's gradients (:mod:`._bucket_gradients`
  records it), so that a rank's share of the bucket is one slice of parameters and one of
  gradients, and the gathered bucket lands in the parameters themselves. Until then (the
  first step or two) the optimizer steps every parameter, as under DDP.
- The optimizer's parameter groups then hold this rank's slices (1-D views, a parameter
  cut where a share ends), its state moves with them, and its step updates only those:
  the optimizer must update each element from that element alone (SGD, Adam, AdamW,
  Adamax, NAdam, RAdam, RMSprop, Adagrad), so the result is the unsharded step's, bit for
  bit. Learning-rate schedulers keep working on the same groups.
- The :data:`WHOLE_FIRST` buckets the forward needs first are stepped whole on every
  rank. Which ones is read from the first forward (for a language model: the
  embedding's, DDP's first bucket where tied, and the first layers'). Their gathers
  would delay the forward before it has work to hide them behind, and stepping a bucket
  costs less than waiting for its gather (AdamW reads and writes 7 bytes per byte of
  parameters at the GPU memory's speed, some 3 TB/s on an H100; a gather moves each byte
  at NVLink's, a twentieth of that).
- After the step each bucket's all-gather starts (asynchronously, in the order the
  forward needs them), on the GPU's copy engines where NCCL can (a communicator of its
  own with NCCL's zero-CTA policy, the buckets in symmetric memory: no SM taken from the
  forward it overlaps), else on NCCL's kernels. With the copy engines up, DDP's buckets
  are rebuilt in symmetric memory too (its second forward), and each all-reduce runs as
  its two halves: a reduce-scatter on NCCL's kernels, then an all-gather on the copy
  engines queued on a side stream (half the SM work beside the backward; the gradients
  the same average). The model's gradients are released after the step, as
  ``zero_grad(set_to_none=True)`` would. Each module that runs in the forward and is the
  innermost such module holding a bucket's parameters (a module of modules, not a layer
  the fusions read as a linear one, which a hook would keep unfused) waits for that
  bucket's gather before its forward (a stream wait on the GPU): the gathers overlap the
  forward's first layers instead of delaying the step. The module's ``state_dict``, the
  next step and :meth:`OptimizerShards.wait` wait for all of them; read the parameters
  otherwise (an EMA copy after the step) only after it
  (``distributed.wait_for_parameters``).
- The optimizer's ``state_dict()`` is the unsharded optimizer's (the slices' state
  gathered: every rank calls it), and a whole optimizer's loads into it, cut to the
  slices.

Not for ``GradScaler`` (each rank would find infinities in its share alone) nor a
CUDA-graph step: both refused (``GradScaler``'s unfused path, ``unscale_`` then ``step``,
cannot be told from a plain step; it is documented, not detected).
"""

from __future__ import annotations

import logging
import weakref
from functools import partial

import torch
import torch.distributed as dist

from ..._errors import InvalidInputError, XpuRuntimeError
from .._linear_view import linear_view
from ._ranks import BUCKET_GRADIENTS, OPTIMIZER_SHARDS
from ._replicated import REPLICATED

__all__ = ["ELEMENTWISE", "WHOLE_FIRST", "OptimizerShards"]

logger = logging.getLogger("xpuruntime.pytorch")

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad")
"""The ``torch.optim`` classes whose step updates each element from that element's own
gradient and state alone: a share of a parameter steps as the whole would."""


WHOLE_FIRST = 2
"""How many of the buckets the forward needs first are stepped whole on every rank
(Llama-3.2-1B, 393 MB buckets, on four H100s: 152.0 ms a step with 2, 155.0 with 1; on
two, 150.2 and 154.1; BENCHMARKS.md)."""


class OptimizerShards:
    """The hooks on ``optimizer`` that split its step over ``ddp``'s ranks (see the
    module's doc); made by :func:`~xpuruntime.pytorch.distributed.shard_optimizer`."""

    def __init__(
        self,
        ddp: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        buckets,
        copy_engines: bool | None = None,
    ) -> None:
        self._ddp = weakref.ref(ddp)
        self._optimizer = optimizer
        self._buckets = buckets  # the BucketGradients hook: DDP's final buckets, once known
        self._group = ddp.process_group
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        self._layout: list[_Bucket] | None = None  # once sharded
        self._pending: dict[int, dist.Work] = {}  # bucket index -> its parameters' gather
        # Ids of the modules seen running a forward, each with its place in the first.
        self._called: dict[int, int] = {}
        root = ddp.module
        device = next(root.parameters()).device
        self._gathers = _Gathers(self._group, device, copy_engines)
        self._rebuilding = None
        if self._gathers.copies and not getattr(ddp, "_has_rebuilt_buckets", False):
            self._rebuilding = ddp.register_forward_pre_hook(self._rebuild_in_symmetric_memory)
        self._recorders = [
            m.register_forward_pre_hook(self._record) for m in root.modules() if _hookable(m)
        ]
        self._params = [list(group["params"]) for group in optimizer.param_groups]
        # Once sharded: each split parameter's slices here (none where another rank steps
        # it all), and each slice's parameter and place in it.
        self._cuts: dict[torch.Tensor, list[tuple[torch.Tensor, int, int]]] = {}
        self._pieces: dict[torch.Tensor, tuple[torch.Tensor, int, int]] = {}
        root.register_state_dict_pre_hook(lambda *_: self.wait())
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_state_dict_post_hook(self._whole_state)
        optimizer.register_load_state_dict_pre_hook(self._split_state)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer now steps this rank's share alone (DDP's buckets known)."""
        return self._layout is not None

    @property
    def whole_parameters(self) -> list[torch.Tensor]:
        """The parameters in the buckets every rank steps whole (the forward's first;
        empty until the split begins)."""
        if self._layout is None:
            return []
        split = {bucket.index for bucket in self._layout}
        return [
            p for index, (_, params, _) in sorted(self._buckets.buckets.items())
            if index not in split for p in params
        ]  # fmt: skip

    def wait(self) -> None:
        """Make the current stream wait until every bucket's parameters are gathered
        (after the step, before reading parameters outside the model's forward)."""
        pending, self._pending = self._pending, {}
        for work in pending.values():
            work.wait()

    def _rebuild_in_symmetric_memory(self, ddp, args) -> None:
        """DDP's bucket rebuild (its second forward), done first, its buckets allocated in
        symmetric memory: then each all-reduce runs as a reduce-scatter on NCCL's kernels
        and an all-gather on the copy engines (:meth:`_Gathers.all_reduce`), half the SM
        work beside the backward."""
        if ddp._has_rebuilt_buckets or not torch.is_grad_enabled():
            return
        with torch.cuda.use_mem_pool(self._gathers.pool):
            rebuilt = ddp.reducer._rebuild_buckets()
        if rebuilt:  # DDP's own call then finds nothing to do
            ddp._has_rebuilt_buckets = True
            self._buckets.halves = self._gathers
            logger.info("shard_optimizer: DDP's buckets rebuilt in symmetric memory")

    def _record(self, module: torch.nn.Module, args) -> None:
        self._called.setdefault(id(module), len(self._called))

    def _before_step(self, optimizer, args, kwargs) -> None:
        if "grad_scaler" in kwargs or getattr(optimizer, "grad_scale", None) is not None:
            raise InvalidInputError(
                "shard_optimizer: not under GradScaler (each rank would find infinities in "
                "its share alone and scale differently); train in bf16, or unsharded"
            )
        self.wait()  # the last gathers read the shares this step writes
        if self._layout is None and self._buckets.buckets and self._called:
            self._shard()
        if self._layout is not None:
            for bucket in self._layout:
                for part, grad in bucket.parts:
                    part.grad = grad

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._layout is None:
            return
        for bucket in self._layout:  # in the order the forward needs them
            self._pending[bucket.index] = dist.all_gather_into_tensor(
                bucket.flat, bucket.share, group=self._gathers.group, async_op=True
            )
            for parameter in bucket.params:
                parameter.grad = None  # zero_grad(set_to_none=True): DDP refills the views

    def _shard(self) -> None:
        ddp = self._ddp()
        if ddp is None:
            raise XpuRuntimeError("shard_optimizer: the DDP model it was made for is gone")
        layout = []
        holders = self._holders(ddp.module)
        order = self._needed_order(ddp.module, holders)
        whole = order[:WHOLE_FIRST]  # the forward's first: stepped whole
        for index in order[WHOLE_FIRST:]:
            buffer, params, views = self._buckets.buckets[index]
            bucket = _Bucket.laid_out(
                index, buffer, params, views, self._rank, self._size, self._gathers.empty
            )
            layout.append(bucket)
        self._cuts = {p: cuts for bucket in layout for p, cuts in bucket.cuts.items()}
        self._pieces = {part: (p, a, b) for p, cuts in self._cuts.items() for part, a, b in cuts}
        self._move_state()
        self._layout = layout
        self._wait_in_forwards(ddp.module, layout, holders)
        for hook in (*self._recorders, self._rebuilding):
            if hook is not None:  # recorded, and rebuilt where DDP ever rebuilds
                hook.remove()
        mine = sum(part.numel() for b in layout for part, _ in b.parts)
        logger.info(
            "shard_optimizer: %s steps %d of %d split parameters on rank %d of %d (%d "
            "bucket(s), gathered on %s) and %d in bucket(s) %s whole",
            type(self._optimizer).__name__, mine, sum(b.numel for b in layout), self._rank,
            self._size, len(layout), self._gathers.how,
            sum(self._buckets.buckets[i][0].numel() for i in whole), whole,
        )  # fmt: skip

    def _move_state(self) -> None:
        """The optimizer's groups and state, from whole parameters to this rank's slices."""
        state = self._optimizer.state
        for group in self._optimizer.param_groups:
            kept = []
            for parameter in group["params"]:
                cuts = self._cuts.get(parameter)
                if cuts is None:  # not in DDP's buckets: stepped whole, as DDP left it
                    kept.append(parameter)
                    continue
                whole = state.pop(parameter, {})
                for part, start, stop in cuts:
                    kept.append(part)
                    if whole:
                        state[part] = {
                            key: _cut(value, parameter, start, stop) for key, value in whole.items()
                        }
            group["params"] = kept

    def _whole_state(self, optimizer, state_dict: dict) -> dict:
        """``state_dict`` as the unsharded optimizer's: the slices' state gathered into
        whole parameters', numbered as before the split (a collective: every rank calls
        ``state_dict()``)."""
        if self._layout is None:
            return state_dict
        state, position = optimizer.state, {}
        for p in (p for params in self._params for p in params):
            position[p] = len(position)
        # What each rank holds: per split parameter its scalar entries (a step count)
        # and the names and dtypes of its per-element ones.
        held: dict[int, tuple[dict, dict]] = {}
        for part, (parameter, _, _) in self._pieces.items():
            entries = state.get(part)
            if entries and position[parameter] not in held:
                scalars = {  # on the CPU: gathered as objects
                    k: v.cpu() if isinstance(v, torch.Tensor) else v
                    for k, v in entries.items() if not _per_element(v, part)
                }  # fmt: skip
                kinds = {k: v.dtype for k, v in entries.items() if _per_element(v, part)}
                held[position[parameter]] = (scalars, kinds)
        everyone: list = [None] * self._size
        dist.all_gather_object(everyone, held, group=self._group)
        for other in everyone:
            for key, value in other.items():
                held.setdefault(key, value)
        whole: dict[int, dict] = {}
        for bucket in self._layout:
            kinds: dict[str, torch.dtype] = {}
            for parameter in bucket.params:
                kinds.update(held.get(position.get(parameter), ({}, {}))[1])
            for key, dtype in kinds.items():
                flat = torch.zeros(bucket.flat.numel(), dtype=dtype, device=bucket.flat.device)
                for parameter in bucket.params:
                    for part, start, stop in bucket.cuts[parameter]:
                        if key in state.get(part, {}):
                            at = bucket.starts[parameter]
                            flat[at + start : at + stop].copy_(state[part][key])
                share = flat[self._rank * bucket.each : (self._rank + 1) * bucket.each]
                dist.all_gather_into_tensor(flat, share, group=self._group)
                for parameter in bucket.params:
                    if position.get(parameter) in held:
                        at = bucket.starts[parameter]
                        entry = whole.setdefault(position[parameter], {})
                        entry[key] = flat[at : at + parameter.numel()].view_as(parameter).clone()
        numbered: dict[int, dict] = {}
        groups = []
        for group, params in zip(state_dict["param_groups"], self._params):
            groups.append({**group, "params": [position[p] for p in params]})
            for p in params:
                if p in self._cuts:
                    if position[p] in held:
                        scalars = held[position[p]][0]
                        numbered[position[p]] = {**scalars, **whole.get(position[p], {})}
                elif state.get(p):
                    numbered[position[p]] = state[p]
        return {"state": numbered, "param_groups": groups}

    def _split_state(self, optimizer, state_dict: dict) -> dict:
        """A whole optimizer's ``state_dict`` (:meth:`_whole_state`'s or an unsharded
        one's) cut to this rank's slices, numbered as the groups now hold them."""
        if self._layout is None:
            return state_dict
        groups = state_dict.get("param_groups", [])
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(params) for params in self._params]:
            raise InvalidInputError(
                f"load_state_dict: groups of {sizes} parameters, this optimizer's are "
                f"{[len(params) for params in self._params]}"
            )
        number = {}
        for group, params in zip(groups, self._params):
            number.update(zip(params, group["params"]))
        incoming = state_dict.get("state", {})
        numbered, renumbered, index = {}, [], 0
        for given, group in zip(groups, optimizer.param_groups):
            indices = []
            for held in group["params"]:
                parameter, start, stop = self._pieces.get(held, (held, None, None))
                entries = incoming.get(number[parameter])
                if entries is not None and start is None:
                    numbered[index] = entries
                elif entries is not None:
                    numbered[index] = {
                        k: _cut(v, parameter, start, stop) for k, v in entries.items()
                    }
                indices.append(index)
                index += 1
            renumbered.append({**given, "params": indices})
        return {"state": numbered, "param_groups": renumbered}

    def _holders(self, root: torch.nn.Module) -> dict[torch.Tensor, torch.nn.Module]:
        """Each parameter's innermost module seen running a forward (where a wait for its
        bucket can go)."""
        depth = {id(m): name.count(".") + bool(name) for name, m in root.named_modules()}
        running = [m for m in root.modules() if id(m) in self._called]
        running.sort(key=lambda m: depth[id(m)], reverse=True)
        holder: dict[torch.Tensor, torch.nn.Module] = {}
        for module in running:
            for parameter in module.parameters():
                holder.setdefault(parameter, module)
        return holder

    def _needed_order(self, root: torch.nn.Module, holders: dict) -> list[int]:
        """DDP's bucket indices in the order the forward first waits for them (when the
        first holder of one of its parameters runs). Not DDP's order reversed: a tied
        embedding is in DDP's first bucket, yet the forward needs it first (gathered
        last, it held the forward 8.8 ms of 142.6, Llama-3.2-1B on four H200s)."""
        first = len(self._called)

        def needed(index: int) -> tuple[int, int]:
            params = self._buckets.buckets[index][1]
            at = min(self._called.get(id(holders.get(p, root)), first) for p in params)
            return at, -index  # a tie: DDP's later bucket (earlier layers) first

        return sorted(self._buckets.buckets, key=needed)

    def _wait_in_forwards(
        self, root: torch.nn.Module, layout: list[_Bucket], holders: dict
    ) -> None:
        """A pre-forward wait on each innermost running module that holds a bucket's
        parameters, for the buckets it holds."""
        waits: dict[torch.nn.Module, set[int]] = {}
        for bucket in layout:
            for parameter in bucket.params:
                waits.setdefault(holders.get(parameter, root), set()).add(bucket.index)
        for module, indices in waits.items():
            module.register_forward_pre_hook(partial(self._wait_for, frozenset(indices)))

    def _wait_for(self, indices: frozenset[int], module, args) -> None:
        for index in indices:
            work = self._pending.pop(index, None)
            if work is not None:
                work.wait()


class _Bucket:
    """One DDP bucket's parameters in one flat buffer laid out as its gradients, and this
    rank's share of it."""

    def __init__(self, index, flat, share, params, parts, cuts, starts, numel) -> None:
        self.index = index
        self.flat = flat  # the bucket's parameters, padded to a multiple of the ranks
        self.share = share  # this rank's slice of ``flat``, what it gathers from
        self.params = params
        self.parts = parts  # (slice of parameters, slice of gradients) this rank steps
        self.cuts = cuts  # parameter -> [(its slice here, start, stop) within it]
        self.starts = starts  # parameter -> where it begins in ``flat``
        self.numel = numel
        self.each = share.numel()  # every rank's share

    @classmethod
    def laid_out(cls, index, buffer, params, views, rank: int, size: int, empty) -> _Bucket:
        numel = buffer.numel()
        each = -(-numel // size)
        flat = empty(each * size, buffer.dtype, buffer.device)
        low, high = rank * each, min(numel, (rank + 1) * each)
        parts, cuts, starts = [], {}, {}
        for parameter, view in zip(params, views):
            start = view.storage_offset() - buffer.storage_offset()
            starts[parameter] = start
            stop = start + parameter.numel()
            placed = flat[start:stop]
            placed.copy_(parameter.detach().reshape(-1))
            parameter.data = placed.view_as(parameter)
            first, last = max(start, low), min(stop, high)
            cuts[parameter] = []  # another rank's to step, where it has no elements here
            if first < last:
                part = flat[first:last]
                parts.append((part, buffer[first:last]))
                cuts[parameter].append((part, first - start, last - start))
        share = flat[rank * each : (rank + 1) * each]
        return cls(index, flat, share, list(params), parts, cuts, starts, numel)


class _Gathers:
    """Where the parameters' all-gathers run: NCCL's copy engines where this torch and
    NCCL can (a communicator of its own with the zero-CTA policy, the buckets allocated in
    symmetric memory and registered with it), else the DDP group as it is."""

    def __init__(self, group, device: torch.device, copy_engines: bool | None) -> None:
        self.group = group
        self.how = "NCCL's kernels" if device.type == "cuda" else dist.get_backend(group)
        self.pool = None  # symmetric memory, where the copy engines gather
        self._registered: set[int] = set()  # the DDP buckets registered with NCCL
        if copy_engines is False or device.type != "cuda":
            if copy_engines:
                raise InvalidInputError(
                    "shard_optimizer: copy_engines=True needs the model on CUDA GPUs (NCCL)"
                )
            return
        try:
            import torch.distributed._symmetric_memory as symmetric

            options = dist.ProcessGroupNCCL.Options()
            options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
            side = dist.new_group(
                dist.get_process_group_ranks(group), backend="nccl", pg_options=options
            )
            symmetric.set_backend("NCCL")
            dist.barrier(group=side)  # the communicator up before any rendezvous
            self.pool = symmetric.get_mem_pool(device)
            self._symmetric = symmetric
            self._side = torch.cuda.Stream(device)  # where a bucket's all-gather is queued
        except (AttributeError, RuntimeError, ValueError) as error:
            if copy_engines:
                raise XpuRuntimeError(
                    f"shard_optimizer: NCCL's copy-engine all-gather is not available here: {error}"
                ) from error
            logger.info("shard_optimizer: gathers on NCCL's kernels (no copy engines: %s)", error)
            return
        self.group, self.how = side, "NCCL's copy engines"

    @property
    def copies(self) -> bool:
        """Whether the gathers run on the copy engines."""
        return self.pool is not None

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.pool is None:
            return torch.empty(numel, dtype=dtype, device=device)
        with torch.cuda.use_mem_pool(self.pool):
            flat = torch.empty(numel, dtype=dtype, device=device)
        self._symmetric.rendezvous(flat, group=self.group.group_name)
        return flat

    def all_reduce(self, index: int, buffer: torch.Tensor, group) -> torch.futures.Future:
        """DDP bucket ``index``'s average, in place: a reduce-scatter on ``group`` (NCCL's
        kernels; the few elements past a multiple of the ranks all-reduced first), then
        an all-gather on the copy engines, queued on a side stream behind it so that the
        backward's stream waits for neither."""
        if index not in self._registered:  # once per bucket, in DDP's order on every rank
            self._symmetric.rendezvous(buffer, group=self.group.group_name)
            self._registered.add(index)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        each = buffer.numel() // size
        head = buffer[: each * size]
        average = dist.ReduceOp.AVG
        last = None
        if buffer.numel() > head.numel():
            last = dist.all_reduce(buffer[head.numel() :], op=average, group=group, async_op=True)
        if each:
            share = head[rank * each : (rank + 1) * each]
            last = dist.reduce_scatter_tensor(share, head, op=average, group=group, async_op=True)
            with torch.cuda.stream(self._side):
                last.wait()  # the side stream, not the backward's, waits for the reduction
                last = dist.all_gather_into_tensor(head, share, group=self.group, async_op=True)
        return last.get_future().then(lambda done: buffer)


def check_shardable(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what :class:`OptimizerShards` cannot split exactly, naming it."""
    name = type(optimizer).__name__
    if type(optimizer) is not getattr(torch.optim, name, None) or name not in ELEMENTWISE:
        raise InvalidInputError(
            f"shard_optimizer: {type(optimizer).__module__}.{name} is not one of torch.optim's "
            f"element-wise optimizers {ELEMENTWISE}; a share of a parameter would not step "
            "as the whole does"
        )
    model_params = {p for p in ddp.module.parameters()}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter not in model_params:
                raise InvalidInputError(
                    "shard_optimizer: the optimizer holds a tensor that is not one of the "
                    "model's parameters; build it over model.parameters()"
                )
            if parameter.requires_grad and not parameter.is_contiguous():
                raise InvalidInputError(
                    f"shard_optimizer: a parameter of shape {tuple(parameter.shape)} is not "
                    "contiguous; it cannot be a slice of its bucket"
                )


def _hookable(module: torch.nn.Module) -> bool:
    """Whether a wait may run before ``module``'s forward: a module of modules, but not
    a layer the fusions read as a linear one (peft's ``lora.Linear``), which a hook would
    keep from being fused."""
    return next(module.children(), None) is not None and linear_view(module) is None


def _per_element(value, part: torch.Tensor) -> bool:
    """Whether a state entry of slice ``part`` holds one value per element."""
    return isinstance(value, torch.Tensor) and value.shape == part.shape


def _cut(value, parameter: torch.Tensor, start: int, stop: int):
    """One entry of a parameter's optimizer state, for its elements ``start:stop``."""
    if isinstance(value, torch.Tensor):
        if value.shape == parameter.shape:
            return value.reshape(-1)[start:stop].clone()
        return value.clone()  # a step count
    return value


def shard_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    copy_engines: bool | None = None,
) -> torch.optim.Optimizer:
    """``optimizer`` stepping only this rank's share of ``model``'s parameters, the rest
    gathered from the other ranks beside the next forward (ZeRO's first stage over DDP's
    buckets, :class:`OptimizerShards`).

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
    buckets = getattr(model, BUCKET_GRADIENTS, None)
    if buckets is None and getattr(model, REPLICATED, None) is not None:
        raise InvalidInputError(
            "shard_optimizer: this model's trained parameters are kept whole on every rank "
            "without DDP (replicate_trained: a small share, such as LoRA adapters), so there "
            "are no DDP buckets to split. Their optimizer state is small: keep the optimizer "
            "whole, or build the model by data_parallel(model, replicate_trained=False)"
        )
    if buckets is None:
        raise InvalidInputError(
            "shard_optimizer: model must come from data_parallel(...) with "
            f"gradients_in_buckets on (its bucket layout is what is split), got {type(model).__name__}"
        )
    if getattr(optimizer, OPTIMIZER_SHARDS, None) is not None:
        raise InvalidInputError("shard_optimizer: this optimizer is sharded already")
    check_shardable(model, optimizer)
    setattr(optimizer, OPTIMIZER_SHARDS, OptimizerShards(model, optimizer, buckets, copy_engines))
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
    shards = getattr(optimizer, OPTIMIZER_SHARDS, None)
    if shards is not None:
        shards.wait()

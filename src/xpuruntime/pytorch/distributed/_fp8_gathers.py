"""Trained weights that FSDP2 gathers in FP8 (``shard``'s ``fp8_gather``), as torchao's
``enable_fsdp_float8_all_gather`` gathers them.

Under ``precision="fp8"`` (tensorwise) the ``linear`` and ``projections`` ops cast each
weight to e4m3 by its amax in every call. Under FSDP2 that weight is first gathered in
bf16 (2 bytes a parameter) and then cast whole on every rank. Gathered in FP8 instead,
each rank casts its own shard before the gather: half the bytes move, and each rank
casts 1/N of the weight.

- :class:`Fp8Shard` is the parameter ``shard`` puts in a trained weight's place before
  ``fully_shard``: the weight itself, seen as itself (every op runs on its values), so
  that FSDP2 shards it, the optimizer steps it and ``state_dict`` saves it as the weight
  it holds (``shard`` unwraps it there). Its ``fsdp_pre_all_gather`` casts the rank's
  shard to e4m3; its ``fsdp_post_all_gather`` gives the gathered bytes as a
  :class:`Fp8Gathered`.
- A tensorwise cast takes the amax of the whole weight, and a joined group (q/k/v, gate
  and up) shares one, as its joined GEMM takes one scale. :class:`Scales` finds them a
  block (FSDP2's unit) at a time: one ``foreach_norm`` over its shards and one
  all-reduce of their amaxes, at the block's first gather after any of its shards was
  written (this dispatch counts every in-place op on a shard: the optimizer's step, a
  ``load_state_dict``). Every rank writes its shards alike, so every rank joins each
  all-reduce at the same gather. No step waits on the host for it. A write past the
  parameter, into the storage of the plain tensors its ``state_dict`` gives, is not
  seen: load a checkpoint with ``load_state_dict`` (as torch.distributed.checkpoint's
  ``set_model_state_dict`` does).
- The gathered weight is an :class:`~.._ops._infra._fp8_gathered.Fp8Gathered`, which
  the FP8 linear op reads as it is.

:func:`gather_in_fp8` chooses the weights (:func:`._fsdp.shard` calls it before
``fully_shard``): the trained weights of the tensorwise FP8 GEMMs that ``optimize`` set
up and noted (:func:`note_fp8_gemms`: joined projections, the linear layers it
swapped), where their rows divide evenly among the ranks.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from ..._errors import InvalidInputError
from .._ops._infra._fp8_gathered import Fp8Gathered
from .._ops._infra._fp8_weight import _seen_as

__all__ = ["Fp8Shard", "Scales", "gather_in_fp8", "note_fp8_gemms", "plain_state"]

logger = logging.getLogger("xpuruntime.pytorch")

E4M3 = torch.float8_e4m3fn
_aten = torch.ops.aten
# The ops FSDP2 shards and moves a parameter with, and autograd's: their results are the
# same weight's values, so they stay an Fp8Shard: views of its shard (which share its
# count of writes) and new blocks or copies of it.
_VIEWS = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten.as_strided.default,
    _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default,
}  # fmt: skip
_COPIES = {
    _aten.new_zeros.default, _aten._to_copy.default, _aten._pin_memory.default,
    _aten.clone.default,
}  # fmt: skip

_NOTED: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref, ...]]] = (
    weakref.WeakKeyDictionary()
)  # model -> its layer groups whose trained weights run tensorwise FP8 GEMMs (weakly)


def note_fp8_gemms(model: nn.Module, groups: list[list[nn.Module]]) -> None:
    """Note ``model``'s layer groups whose GEMMs run tensorwise FP8, for
    :func:`gather_in_fp8` (``optimize`` knows them); an empty list forgets them."""
    _NOTED[model] = [tuple(weakref.ref(layer) for layer in group) for group in groups]


def gather_in_fp8(
    model: nn.Module, blocks: list[nn.Module], world: int, wanted: bool | None
) -> int:
    """Put an :class:`Fp8Shard` in the place of each trained weight of the layers whose
    GEMMs run tensorwise FP8 (:func:`note_fp8_gemms`) where FSDP2 can gather it so; how
    many. ``blocks``: the units FSDP2 gathers one by one (each finds its weights'
    amaxes at its gather). ``wanted`` None: wherever there are such weights; False:
    none; True: as None, but a model with none raises."""
    if wanted is False:
        return 0
    groups, why = _groups(model, world)
    for path, reason in why:
        logger.info("shard: %s gathered as it is, not in FP8: %s", path, reason)
    if not groups:
        if wanted:
            raise InvalidInputError(
                "shard: fp8_gather=True, but no trained weight runs tensorwise FP8 GEMMs: "
                "optimize the model first with precision='fp8' on a GPU with FP8 "
                f"({'; '.join(f'{p}: {r}' for p, r in why) or 'none noted'})"
            )
        return 0
    _wrap(model, groups, blocks)
    count = sum(len(group) for group in groups)
    logger.info("shard: %d trained weight(s) in %d group(s) gathered in FP8 (e4m3, each "
                "group's amax over the ranks), not in bf16", count, len(groups))  # fmt: skip
    return count


def _groups(model: nn.Module, world: int):
    """The weights to gather in FP8, by the groups that share an amax (a joined GEMM's
    weights, or one layer's), as ``[(module, weight), ...]``; and the paths of those
    noted but left as they are, with why."""
    layers = [[ref() for ref in refs] for refs in _NOTED.get(model, ())]
    paths = {id(m): name for name, m in model.named_modules()}
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    groups, why = [], []
    for group in layers:
        if not all(m is not None and id(m) in paths for m in group):
            continue  # (no longer in the model)
        weights = [getattr(m, "weight", None) for m in group]
        if not all(isinstance(w, nn.Parameter) and w.requires_grad for w in weights):
            continue  # frozen (a LoRA base): not the tensorwise cast of a trained weight
        reason = _unfit(weights, uses, world)
        if reason is None:
            groups.append(list(zip(group, weights)))
        else:
            why.append((", ".join(paths[id(m)] for m in group), reason))
    return groups, why


def _unfit(weights: list[nn.Parameter], uses: dict[int, int], world: int) -> str | None:
    for w in weights:
        if type(w) is not nn.Parameter or type(w.data) is not torch.Tensor:
            return f"a {type(w.data).__name__} weight"
        if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"a {w.dim()}-D {w.dtype} weight"
        if uses[id(w)] > 1:
            return "a weight tied to another module's"
        if w.shape[0] % world:
            return f"{w.shape[0]} rows, which {world} ranks cannot share evenly"
    return None


def _wrap(model: nn.Module, groups, blocks: list[nn.Module]) -> None:
    block_of = {id(m): number for number, block in enumerate(blocks) for m in block.modules()}
    units = [block_of.get(id(group[0][0]), -1) for group in groups]  # (-1: the model's)
    scales = Scales(model, units)
    for number, group in enumerate(groups):
        for module, weight in group:
            shard = Fp8Shard(weight.detach(), scales, number)
            module.weight = nn.Parameter(shard, requires_grad=weight.requires_grad)
    model.register_state_dict_post_hook(plain_state)


class _Writes:
    """The in-place writes to one weight's shard (shared by its views)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Fp8Shard(torch.Tensor):
    """A trained weight (under FSDP2, its shard) that FSDP2 gathers in e4m3: the weight
    seen as itself (see the module's text). ``group`` numbers the weights that share one
    amax (a joined GEMM's); ``scales`` finds it."""

    _tensor: Tensor

    @staticmethod
    def __new__(cls, tensor: Tensor, scales: Scales, group: int, writes: _Writes | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad,
        )  # fmt: skip

    def __init__(self, tensor: Tensor, scales: Scales, group: int, writes: _Writes | None = None):
        self._tensor, self.scales, self.group = tensor, scales, group
        self.writes = writes if writes is not None else _Writes()

    def __repr__(self) -> str:
        return f"Fp8Shard({self._tensor!r}, gathered in e4m3)"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (the shard whose table and group an op's result keeps)
        first = next((t for t in _tensors(args, kwargs) if isinstance(t, Fp8Shard)), None)
        if func._schema.is_mutable:
            for shard in _written(func, args, kwargs):
                shard.writes.count += 1
        unwrapped_args, unwrapped_kwargs = tree_map_only(
            Fp8Shard, lambda t: t._tensor, (args, kwargs)
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func is _aten.copy_.default and isinstance(args[0], Fp8Shard):
            return args[0]
        if first is None:
            return out
        if func in _COPIES:
            return tree_map_only(Tensor, lambda t: Fp8Shard(t, first.scales, first.group), out)
        if func in _VIEWS:
            return tree_map_only(
                Tensor, lambda t: Fp8Shard(t, first.scales, first.group, first.writes), out
            )
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard cast to e4m3 by its group's amax (seen as the dtype the
        block gathers in, so that its gather is one buffer), and the inverse scale."""
        from .._ops.fp8 import quantize

        amax = self.scales.amax(self, mesh)
        shard = self._tensor.reshape(self._tensor.shape[0], -1)
        data, _, inverse = quantize(shard, E4M3, "tensor", amax=amax)
        like = getattr(mp_policy, "param_dtype", None) or self.dtype
        return (_seen_as(data.view(self._tensor.shape), like),), (inverse, self.group)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight over FSDP2's gathered bytes (``out``, the one made by the
        first gather, takes this gather's scale)."""
        inverse, group = metadata
        if out is not None:
            out.inverse = inverse
            return None
        data = outputs[0].view(E4M3)
        return Fp8Gathered(data, inverse, group, param_dtype or self.dtype), (data,)


# FSDP2 reads the hook's signature on every gather (see _fp8_weight.py).
Fp8Shard.fsdp_pre_all_gather.__signature__ = inspect.signature(Fp8Shard.fsdp_pre_all_gather)


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))
        elif isinstance(value, Tensor):
            yield value


def _written(func, args, kwargs) -> list[Fp8Shard]:
    """The shards ``func`` writes in place (a list argument's too: a fused optimizer's)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, Fp8Shard)]
    return written


class Scales:
    """The amax of each weight of ``model`` gathered in FP8, each group's the largest of
    its members', over all ranks (see the module's text). ``units[g]`` is the block
    (FSDP2's unit) group ``g`` is gathered with: a block's amaxes are found at its own
    gather, behind the compute that FSDP2 prefetches it beside, not the whole model's at
    the forward's first gather."""

    def __init__(self, model: torch.nn.Module, units: list[int]) -> None:
        self._model, self.units = weakref.ref(model), units
        self._found: dict[int, tuple[int, Tensor]] = {}  # id(writes) -> (count, amax)
        # unit -> (its shards, each one's group's place among the unit's groups, how many)
        self._members: dict[int, tuple[list[Fp8Shard], Tensor, int]] = {}

    def amax(self, shard: Fp8Shard, mesh) -> Tensor:
        """``shard``'s group's amax, found again over its block where any shard of it was
        written since (or ``shard`` is not one found last time)."""
        found = self._found.get(id(shard.writes))
        if found is None or found[0] != shard.writes.count:
            self._refresh(self.units[shard.group], shard, mesh)
            found = self._found[id(shard.writes)]
        return found[1]

    def _refresh(self, unit: int, shard: Fp8Shard, mesh) -> None:
        members = self._members.get(unit)
        if members is None or not any(s is shard for s in members[0]):
            # FSDP2 made new shards: found anew, and what was found for the old ones
            # dropped (their ids may be taken again).
            self._members, self._found = self._gather_members(), {}
            members = self._members[unit]
        shards, places, count = members
        local = torch.stack(torch._foreach_norm([s._tensor for s in shards], math.inf))
        local = local.float()
        if mesh is not None and mesh.size() > 1:
            torch.distributed.all_reduce(
                local, torch.distributed.ReduceOp.MAX, group=mesh.get_group()
            )
        most = local.new_zeros(count).scatter_reduce(0, places, local, "amax", include_self=False)
        most = most[places]
        for i, s in enumerate(shards):
            self._found[id(s.writes)] = (s.writes.count, most[i])

    def _gather_members(self) -> dict[int, tuple[list[Fp8Shard], Tensor, int]]:
        by_unit: dict[int, list[Fp8Shard]] = {}
        for s in self.shards():
            by_unit.setdefault(self.units[s.group], []).append(s)
        members = {}
        for unit, shards in by_unit.items():
            numbers = sorted({s.group for s in shards})
            places = [numbers.index(s.group) for s in shards]
            index = torch.tensor(places, device=shards[0].device)
            members[unit] = (shards, index, len(numbers))
        return members

    def shards(self) -> list[Fp8Shard]:
        """The model's shards of this table, in the order of its parameters (the same
        on every rank)."""
        model = self._model()
        found = []
        for p in model.parameters() if model is not None else ():
            local = getattr(p, "_local_tensor", p)
            if isinstance(local, Fp8Shard) and local.scales is self:
                found.append(local)
        return found


def plain_state(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A ``state_dict`` post-hook: each weight held as an :class:`Fp8Shard` saved as the
    plain tensor it holds (a DTensor over it under FSDP2), so that a checkpoint loads
    without this package."""
    from torch.distributed.tensor import DTensor

    for name, value in state_dict.items():
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, Fp8Shard):
            continue
        if isinstance(value, DTensor):
            state_dict[name] = DTensor.from_local(
                local._tensor, value.device_mesh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride(),
            )  # fmt: skip
        else:
            state_dict[name] = local._tensor

"""Which trained weights :func:`._fsdp.shard` has FSDP2 gather in FP8 (``fp8_gather``),
and putting :class:`~.._ops._infra._fp8_gather.Fp8Shard` in their places."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..._errors import BackendUnavailableError, InvalidInputError

__all__ = ["gather_in_fp8"]

logger = logging.getLogger("xpuruntime.pytorch")


def gather_in_fp8(
    model: nn.Module, blocks: list[nn.Module], world: int, wanted: bool | None
) -> int:
    """Put an :class:`Fp8Shard` in the place of each weight whose GEMMs run tensorwise
    FP8 (``precision="fp8"``) where FSDP2 can gather it so; how many. ``blocks``: the
    units FSDP2 gathers one by one (each finds its weights' amaxes at its gather).
    ``wanted`` None: where the policy's precision is ``fp8`` on a device with FP8;
    False: none; True: as None, but a policy or device without FP8 raises."""
    from .._kernels.fp8 import fp8_refusal
    from .._selection._policy import get_kernel_policy

    if wanted is False:
        return 0
    precision = getattr(get_kernel_policy(), "precision", None)
    if precision != "fp8":
        if wanted:
            raise InvalidInputError(
                f"shard: fp8_gather=True needs the policy's precision 'fp8' (tensorwise: one "
                f"scale a weight, cast before the gather), not {precision!r}"
            )
        return 0
    groups, why = _groups(model, world)
    devices = {w.device for group in groups for _, w in group}
    for device in sorted(devices, key=str):
        refused = fp8_refusal(device)
        if refused is not None:
            if wanted:
                raise BackendUnavailableError(f"shard: fp8_gather=True, but {refused}")
            logger.info("shard: weights gathered in bf16, not FP8: %s", refused)
            return 0
    for path, reason in why:
        logger.info("shard: %s gathered as it is, not in FP8: %s", path, reason)
    if not groups:
        return 0
    _wrap(model, groups, blocks)
    count = sum(len(group) for group in groups)
    logger.info("shard: %d trained weight(s) in %d group(s) gathered in FP8 (e4m3, each "
                "group's amax over the ranks), not in bf16", count, len(groups))  # fmt: skip
    return count


def _groups(model: nn.Module, world: int):
    """The weights to gather in FP8, by the groups that share an amax (a joined GEMM's
    weights, or one layer's), as ``[(module, weight), ...]``; and the paths of those
    that run FP8 but are left as they are, with why."""
    from .. import nn as routed
    from .._kernels.fp8 import FP8_MIN_WEIGHT
    from .._optimize._apply import joined_layers

    layers = joined_layers(model)
    taken = {id(layer) for group in layers for layer in group}
    layers += [[m] for m in model.modules() if type(m) is routed.Linear and id(m) not in taken]
    paths = {id(m): name for name, m in model.named_modules()}
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    groups, why = [], []
    for group in layers:
        if not all(id(m) in paths for m in group):
            continue  # (no longer in the model)
        weights = [getattr(m, "weight", None) for m in group]
        if not all(isinstance(w, nn.Parameter) and w.requires_grad for w in weights):
            continue  # frozen (a LoRA base): not the tensorwise cast of a trained weight
        if sum(w.numel() for w in weights) < FP8_MIN_WEIGHT:
            continue  # its GEMMs stay in the compute dtype (the stated table)
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
    from .._ops._infra._fp8_gather import Fp8Shard, Scales, plain_state

    block_of = {id(m): number for number, block in enumerate(blocks) for m in block.modules()}
    units = [block_of.get(id(group[0][0]), -1) for group in groups]  # (-1: the model's)
    scales = Scales(model, units)
    for number, group in enumerate(groups):
        for module, weight in group:
            shard = Fp8Shard(weight.detach(), scales, number)
            module.weight = nn.Parameter(shard, requires_grad=weight.requires_grad)
    model.register_state_dict_post_hook(plain_state)

"""``shard``: FSDP2 (``fully_shard``) per repeated block, then the model, with the
mixed precision and resharding chosen for the model's size."""

from __future__ import annotations

import logging

import torch

from ..._errors import InvalidInputError, UnsupportedOperationError
from ._fp8_gathers import gather_in_fp8
from ._ranks import is_initialized
from ._replicated import keep_whole, replicates

__all__ = [
    "KEEP_GATHERED",
    "gathered_bytes",
    "shard",
]

logger = logging.getLogger("xpuruntime.pytorch")

_PRECISIONS = ("bf16", "fp32")


def shard(
    model: torch.nn.Module,
    *,
    precision: str = "bf16",
    blocks: list[torch.nn.Module] | None = None,
    reshard_after_forward: bool | None = None,
    replicate_trained: bool | None = None,
    fp8_gather: bool | None = None,
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
    replicate_trained : bool, optional
        Keep the trained parameters whole on every rank, out of FSDP2
        (:mod:`._replicated`). Their gradients are averaged in buckets during the
        backward. FSDP2 then gathers only the frozen parameters and reduces nothing.
        None (the default): where some parameters are frozen and the trained ones are
        at most ``REPLICATED_SHARE`` of the model (a LoRA model's adapters). As under
        DDP, each backward must give every trained parameter a gradient; the next
        forward raises ``UnsupportedOperationError`` naming any that got none.
    fp8_gather : bool, optional
        Gather the trained weights whose GEMMs run tensorwise FP8 (a model optimized
        under ``precision='fp8'`` on a GPU with FP8) as e4m3 bytes, each rank casting
        its own shard, as torchao's ``enable_fsdp_float8_all_gather`` does: half a bf16
        gather's bytes, and no cast of the gathered weight (:mod:`._fp8_gathers`). A
        joined GEMM's weights (q/k/v, gate and up) share one scale. None (the
        default): wherever there are such weights; True raises where there are none.

    Returns
    -------
    torch.nn.Module
        ``model``, sharded in place.

    Raises
    ------
    InvalidInputError
        No process group is up, ``precision`` or ``reshard_after_forward`` is not one
        of the above, the model has no repeated blocks and none were given, a weight
        stored in FP8 (the policy's ``fp8_base``) has rows the ranks cannot share
        evenly, or ``fp8_gather=True`` where no trained weight runs tensorwise FP8.
    UnsupportedOperationError
        A parameter is a bitsandbytes quantized weight (QLoRA's 4-bit base): FSDP2
        cannot shard it; ``data_parallel`` spreads such a model.

    Notes
    -----
    Weights stored in FP8 (``fp8_base``) stay FP8 when sharded: each rank keeps whole
    rows with their scales, and a block's gather moves the FP8 bytes, half a bf16
    gather (:class:`~.._ops._infra._fp8_weight.Fp8Weight`); the choice of
    ``reshard_after_forward`` counts those bytes (:func:`gathered_bytes`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if reshard_after_forward not in (None, True, False):
        raise InvalidInputError(
            f"shard: reshard_after_forward must be True, False or None (chosen), got "
            f"{reshard_after_forward!r}"
        )
    replicate = replicates(model, replicate_trained, "shard")
    if not is_initialized():
        raise InvalidInputError(
            "shard: no process group is up; call init_distributed() first (under torchrun)"
        )
    if precision not in _PRECISIONS:
        raise InvalidInputError(f"shard: precision must be one of {_PRECISIONS}, got {precision!r}")
    if fp8_gather not in (None, True, False):
        raise InvalidInputError(
            f"shard: fp8_gather must be True, False or None (chosen), got {fp8_gather!r}"
        )
    world = torch.distributed.get_world_size()
    _refuse_quantized(model)
    stored = _check_stored_rows(model, world)
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
    gather_in_fp8(model, blocks, world, fp8_gather)
    mixed = MixedPrecisionPolicy()  # the parameters' own dtype
    if precision == "bf16":
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ignored = {p for p in model.parameters() if p.requires_grad} if replicate else set()
    if reshard_after_forward is None:
        reshard_after_forward = _reshard_after_forward(blocks, mixed.param_dtype, ignored)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mixed,
                    ignored_params=ignored)  # fmt: skip
    fully_shard(model, mp_policy=mixed, ignored_params=ignored)
    logger.info("shard: %d %s block(s) and the model, computed in %s",
                len(blocks), type(blocks[0]).__name__, precision)  # fmt: skip
    if ignored:
        keep_whole(model, "shard")
    if stored:
        logger.info("shard: %d weight(s) stored in FP8 (fp8_base) kept FP8 in their shards "
                    "and gathered as FP8 bytes with their row scales", stored)  # fmt: skip
    return model


def _refuse_quantized(model: torch.nn.Module) -> None:
    """Raise where a parameter is bitsandbytes' (QLoRA's 4-bit base, an 8-bit weight):
    its quantization state describes the whole weight, and FSDP2's shard and gather
    would leave the gathered bytes without it (bitsandbytes then fails in the forward)."""
    for name, p in model.named_parameters():
        if type(p).__module__.startswith("bitsandbytes"):
            raise UnsupportedOperationError(
                f"shard: {name} is a bitsandbytes {type(p).__name__} (a quantized base, as "
                "QLoRA's), whose quantization state FSDP2's shards would not carry. Spread "
                "the model with data_parallel (or DDP) instead: each rank holds the "
                "quantized base, and the adapters' gradients are averaged"
            )


def _check_stored_rows(model: torch.nn.Module, world: int) -> int:
    """How many weights are stored in FP8 (``fp8_base``); raise where one has rows that
    ``world`` ranks cannot share evenly: FSDP2 pads the last rank's block, and a block's
    gathered bytes and scales must be of one size on every rank."""
    from .._ops._infra._fp8_weight import Fp8Weight

    stored = [(name, p) for name, p in model.named_parameters() if type(p) is Fp8Weight]
    for name, p in stored:
        if p.shape[0] % world:
            raise InvalidInputError(
                f"shard: {name} is stored in FP8 (the policy's fp8_base) with {p.shape[0]} "
                f"rows, which {world} ranks cannot share evenly; FSDP2 gathers a stored "
                "weight as whole rows with their scales. Use a world size that divides "
                "its rows, or optimize without fp8_base"
            )
    return len(stored)


KEEP_GATHERED = 0.08
"""The share of a GPU's memory up to which :func:`shard` keeps the blocks' gathered
parameters from the forward to the backward (Llama-3.2-1B's decoder layers in bf16 take
about 2% of an 80 GB H100: kept; Llama-3.1-8B's about 17%: resharded)."""


def _reshard_after_forward(
    blocks: list[torch.nn.Module], dtype: torch.dtype | None, ignored: set[torch.Tensor]
) -> bool:
    """Whether :func:`shard` frees each block's gathered parameters after its forward:
    unless they all fit in ``KEEP_GATHERED`` of this rank's GPU (logged either way)."""
    params = [p for block in blocks for p in block.parameters() if p not in ignored]
    gathered = gathered_bytes(params, dtype)
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


def gathered_bytes(params: list[torch.Tensor], dtype: torch.dtype | None) -> int:
    """The bytes FSDP2 gathers for ``params`` computed in ``dtype`` (None: their own):
    a weight stored in FP8 moves its bytes and row scales, whatever its dtype reads as,
    and one gathered in FP8 (``fp8_gather``) a byte a parameter."""
    from .._ops._infra._fp8_weight import Fp8Weight
    from ._fp8_gathers import Fp8Shard

    return sum(
        p.qdata.nbytes + p.scale.nbytes
        if type(p) is Fp8Weight
        else p.numel()
        if type(p) is Fp8Shard
        else p.numel() * (dtype or p.dtype).itemsize
        for p in params
    )


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

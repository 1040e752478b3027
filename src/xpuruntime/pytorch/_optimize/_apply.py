"""optimize(model, policy): the patterns of ``patterns/`` applied to a model, one table
in one order, each acting through one run (:mod:`._run`); the report says what was
replaced, what was not and why, and undoes it all."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..._errors import InvalidInputError
from ...policies import KernelPolicy
from .._ops.lora_linear import quant_state
from .._selection._policy import get_kernel_policy
from ._probes import weights_left_as_they_are
from ._report import OptimizationReport
from ._run import Run
from .patterns import FINDINGS, MODEL_PATTERNS, MODULE_PATTERNS

__all__ = ["OptimizationReport", "optimize"]

# Each optimized model's report's status: a second optimize() of it changes nothing and
# says so, until the first is reverted.
_OPTIMIZED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def optimize(
    model: nn.Module,
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    filter: Callable[[nn.Module, str], bool] | None = None,
) -> OptimizationReport:
    """Rewrite ``model`` in place onto the policy's kernels, and say what now runs.

    Each pattern (``patterns/``) recognises a block by what it computes on probe inputs
    and binds a fused forward on that instance alone; what cannot run fused is left as
    written, the reason in the report. The training guide lists the patterns.

    Parameters
    ----------
    model : nn.Module
        Changed in place.
    policy : KernelPolicy, dict, path or None
        Set process-wide until ``revert()``; None keeps the policy in force.
    filter : callable, optional
        ``filter(module, path) -> bool``: False leaves that module as written.

    Returns
    -------
    OptimizationReport
        What was replaced, what was skipped and why; ``revert()`` undoes it all.

    Raises
    ------
    InvalidInputError, PolicyError, UnsupportedOperationError, BackendUnavailableError
        A bad model, filter or policy (nothing is changed), or strict without Triton.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"optimize: expected an nn.Module, got {type(model).__name__}")
    if filter is not None and not callable(filter):
        raise InvalidInputError(
            f"optimize: filter must be a callable filter(module, path) -> bool, got "
            f"{type(filter).__name__}"
        )
    report = OptimizationReport(FINDINGS)
    if policy is not None:
        report.set_policy(policy)
    earlier = _OPTIMIZED.get(model)
    if earlier is not None and not earlier.reverted:
        why = (
            "already optimized by an earlier optimize() call, so nothing was changed; that "
            "call's report.revert() undoes it (then optimize afresh)"
        )
        report.skipped.append(("<model>", why))
        warnings.warn(f"optimize: the model is {why}", stacklevel=2)
        report.attention = _attention_routing(get_kernel_policy())
        return report
    _OPTIMIZED[model] = report.status
    try:
        _apply(model, report, filter)
    except BaseException:
        # Nothing left half-done: what was applied is undone, the policy from before is
        # back, and the model is not marked optimized (a later call starts afresh).
        report.revert()
        _OPTIMIZED.pop(model, None)
        raise
    _note_fp8_gemms(model, report)
    report.attention = _attention_routing(get_kernel_policy())
    report.triton_missing = _triton_missing(model)
    return report


def _note_fp8_gemms(model: nn.Module, report: OptimizationReport) -> None:
    """Under ``precision="fp8"``, note the model's layer groups whose GEMMs run tensorwise
    FP8 (its joined projections and the linear layers swapped for FP8, each at least the
    size table's, on a device with FP8), for ``xpt.distributed.shard`` to gather their
    trained weights in FP8; forgotten on revert."""
    from .. import nn as routed
    from .._kernels.fp8 import FP8_MIN_WEIGHT, fp8_refusal
    from ..distributed._fp8_gathers import note_fp8_gemms

    if getattr(get_kernel_policy(), "precision", None) != "fp8":
        return
    groups = [[ref() for ref in refs] for refs in report.status.joined]
    groups = [group for group in groups if all(layer is not None for layer in group)]
    taken = {id(layer) for group in groups for layer in group}
    groups += [[m] for m in model.modules() if type(m) is routed.Linear and id(m) not in taken]
    noted = []
    for group in groups:
        weights = [getattr(layer, "weight", None) for layer in group]
        if not all(isinstance(w, torch.Tensor) for w in weights):
            continue
        if sum(w.numel() for w in weights) >= FP8_MIN_WEIGHT:
            if fp8_refusal(weights[0].device) is None:
                noted.append(group)
    note_fp8_gemms(model, noted)
    report.on_revert(lambda: note_fp8_gemms(model, []))


def _apply(model: nn.Module, report: OptimizationReport, filter: Any) -> None:
    """The patterns applied to ``model`` (each refusal under ``strict`` raised before
    any changes it: :class:`.Run`'s and the patterns' ``enabled``)."""
    run = Run(model, report, filter)
    patterns = [pattern for pattern in MODULE_PATTERNS if pattern.enabled(run)]
    model_patterns = [pattern for pattern in MODEL_PATTERNS if pattern.enabled(run)]
    with weights_left_as_they_are(model):
        for path, parent, name, module in _children(model):
            if not run.chosen(module, path):
                run.skip(path, "the filter refused it: left as written")
                continue
            for pattern in patterns:
                if pattern.apply(run, path, parent, name, module):
                    break  # settled: no later pattern looks at this module
        for pattern in model_patterns:
            pattern.apply_model(run)
    _note_bare_4bit(model, run)


BARE_4BIT = (
    "a bitsandbytes 4-bit layer without a LoRA adapter, left to bitsandbytes as written: "
    "the policy runs no lora_linear kernel of ours, which would run it joined with the "
    "layers beside it and fuse a gated MLP of such layers"
)


def _note_bare_4bit(model: nn.Module, run: Run) -> None:
    """Say where a bitsandbytes quantized layer without a LoRA adapter (peft's default
    targets adapt only q_proj and v_proj) was left as written (the lora_linear op off),
    so that a QLoRA user sees why its group or MLP was not fused."""
    adapted = set()  # peft's layers and the base layers they wrap
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module):
            adapted |= {id(module), id(base)}
    for path, module in model.named_modules():
        if id(module) in adapted or id(module) in run.joined:
            continue
        if quant_state(getattr(module, "weight", None)) is not None:
            run.skip(path, BARE_4BIT)


def _triton_missing(model: nn.Module) -> tuple[str, str] | None:
    """(device, why) where the device of the model's parameters cannot run our Triton
    kernels (None where it can, or the parameters are on several devices or none)."""
    from .._ops._infra._launch import triton_unavailable

    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return None
    device = devices.pop()
    why = None if device.type == "meta" else triton_unavailable(device)
    return None if why is None else (str(device), why)


def _children(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(path, parent, attribute name, module) for every submodule, each once."""
    seen: set[int] = set()
    for parent_path, parent in model.named_modules():
        for name, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            yield (f"{parent_path}.{name}" if parent_path else name), parent, name, child


def _attention_routing(policy: KernelPolicy | None) -> str:
    choice = None if policy is None else policy.get("attention")
    if choice in (None, "auto"):
        return (
            "F.scaled_dot_product_attention calls keep PyTorch's backend choice; "
            "ops.fused_attention calls are resolved per shape (auto)"
        )
    if choice == "triton":
        return (
            "ops.fused_attention calls run our Triton kernel; direct "
            "F.scaled_dot_product_attention calls keep PyTorch's backend choice (call "
            "ops.fused_attention in the model to route them)"
        )
    from .._selection._resolution import sdpa_backend_unavailable

    why = sdpa_backend_unavailable(choice)
    if why is not None:
        return f"F.scaled_dot_product_attention calls keep PyTorch's backend choice: {why}"
    if policy.strict or choice == "math":
        return (
            f"F.scaled_dot_product_attention and ops.fused_attention calls run {choice} "
            "(PyTorch's SDPA switches are set by the policy)"
        )
    return (
        f"F.scaled_dot_product_attention and ops.fused_attention calls run {choice} where "
        "it takes the call, math elsewhere (PyTorch's SDPA switches are set by the policy; "
        "not strict)"
    )

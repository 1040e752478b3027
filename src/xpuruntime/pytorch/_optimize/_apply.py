"""optimize(model, policy): the patterns of ``patterns/`` applied to a model, one table
in one order, each acting through one run (:mod:`._run`); the report says what was
replaced, what was not and why, and undoes it all."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from ..._errors import InvalidInputError
from ...policies import KernelPolicy
from .._selection._policy import get_kernel_policy
from ._probes import weights_left_as_they_are
from ._report import OptimizationReport
from ._run import Run
from .patterns import FINDINGS, MODEL_PATTERNS, MODULE_PATTERNS

__all__ = ["OptimizationReport", "optimize"]

# Each optimized model's report: a second optimize() of it changes nothing and says so.
_OPTIMIZED: weakref.WeakKeyDictionary[nn.Module, OptimizationReport] = weakref.WeakKeyDictionary()


def optimize(
    model: nn.Module,
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    filter: Callable[[nn.Module, str], bool] | None = None,
) -> OptimizationReport:
    """Replace a model's norms by our policy-routed modules and apply ``policy``: every
    pattern of the table in ``patterns/`` (one file each), in its order.

        ``nn.LayerNorm`` becomes :class:`nn.LayerNorm` and ``nn.RMSNorm`` :class:`nn.RMSNorm`,
        and so does any module that computes an RMSNorm whatever its class (Llama's,
        Mistral's, Qwen's, Phi-3's, T5's, ...: a leaf holding a 1-D ``weight`` and a float
        epsilon, run once on probe inputs and compared with the formula; look-alikes that
        compute something else are listed in ``skipped``; Gemma's ``(1 + weight)`` form becomes one
        with ``weight_offset=1``
        with what they compute); a
        language-model head (an ``nn.Linear`` named ``lm_head`` or tied to an embedding)
        becomes a :class:`LinearCrossEntropyHead`, whose logits ``F.cross_entropy`` computes
        without materialising them (:func:`ops.fused_linear_cross_entropy`) unless the
        policy's ``cross_entropy`` is ``torch``; any other use of the logits materialises
        them. Replacements share the original parameters: ``state_dict`` keys, optimizer
        state and weight tying are unchanged. Each runs the kernel the policy's
        ``layernorm`` / ``rmsnorm`` / ``cross_entropy`` op picks (``auto`` when the policy
        leaves it open). When the policy names a ``linear`` kernel, the other ``nn.Linear``
        layers become :class:`nn.Linear` (routed by that op); otherwise they are left
        as they are. When the policy names a ``residual_layernorm`` kernel other than
        ``torch``, the forwards that compute ``norm(a + b)`` and use the sum again (a pre-norm
        block's residual stream) are rewritten with ``torch.fx`` so that the add and the norm
        run as one op (:func:`ops.fused_add_layernorm` where the op picks ``fused``); likewise
        for ``linear_gelu``, the forwards that feed a linear layer's output to a GELU alone
        (:func:`ops.fused_linear_gelu`), and for ``mlp``, those that feed it on to a second
        linear layer alone (:func:`ops.fused_mlp`). Unless it names ``torch`` for ``swiglu``
        (``auto`` leaves the choice per call to the op), every module that computes
        ``down(silu(gate(x)) * up(x))`` (Llama's
        MLP and its many copies, recognised on probe inputs, whatever the class or child
        names) gets a forward, bound on that instance, whose activation is the ``swiglu``
        op (:func:`ops.swiglu`); likewise ``geglu`` for Gemma's ``down(gelu_tanh(gate(x)) *
        up(x))`` (:func:`ops.geglu`). Unless it names ``torch`` for ``rope``, every
        attention module whose forward calls its modeling file's ``apply_rotary_pos_emb``
        (transformers' Llama and its copies), where that function computes the half-split or
        interleaved rotation on probe inputs, gets a copy of its forward, bound on the
        instance, that calls the ``rope`` op instead (:func:`ops.rope`). Unless it names
        ``torch`` for ``residual_rmsnorm``, every decoder layer whose forward computes ``h =
        residual + h; residual = h; h = self.<norm>(h)`` with an RMSNorm (transformers'
        Llama and ~250 modeling files) gets a copy of its forward, bound on the instance, in
        which those statements are that op (:func:`ops.fused_add_rmsnorm` where it picks
        ``fused``); with a LayerNorm (GPT-2's ``h = attn_output + residual``), the
        ``residual_layernorm`` op, unless the policy names ``torch`` for it; likewise, unless it names ``torch`` for ``linear_gelu``, a forward whose
        ``h = self.<layer>(h); h = self.<act>(h)`` is a linear layer (or transformers'
        ``Conv1D``) and a GELU module, by probe (GPT-2's MLP), runs that pair as the
        ``linear_gelu`` op (:func:`ops.fused_linear_gelu`). Unless it names ``torch`` for
        ``projections``, a forward whose consecutive statements each call a linear layer on
        the same input (attention's ``self.q_proj(h)``, ``self.k_proj(h)``,
        ``self.v_proj(h)``) calls them together as that op, one GEMM over the joined weights
        where it picks ``fused`` (one cast and one kept copy of the input; its gradient
        summed inside one GEMM); a gated MLP's gate and up likewise, its activation then
        taking the joined output whole (not where the policy names a ``linear`` kernel: the
        layers are then that op's). A forward that cannot be traced, or a
        torch.compile'd model, is listed in ``skipped`` with the reason (compile the model
        after this call instead: our ops trace as registered torch ops). The rewrite sees the
        model's modules as they are now: call ``revert()`` before swapping modules. Without
        Triton (a CPU-only PyTorch install, macOS) the norms are replaced and run PyTorch's
        kernels, every fusion is left as written and ``skipped`` says so.

        Parameters
        ----------
        model : nn.Module
            Changed in place.
        policy : KernelPolicy, dict, path or None
            Set process-wide (as :func:`set_kernel_policy`) until :meth:`revert`; None keeps
            the policy in force.
        filter : callable, optional
            ``filter(module, path) -> bool``, asked of every submodule (as torchao's
            ``filter_fn``): False leaves that module as written (its children are asked in
            turn), for instance a vision tower: ``lambda m, path: not
            path.startswith("vision_tower")``.

        Returns
        -------
        OptimizationReport
            What was replaced, what was skipped and why, how attention is routed; its
            ``revert()`` undoes everything.

        Raises
        ------
        InvalidInputError
            ``model`` is not an ``nn.Module``, or ``filter`` is not callable.
        PolicyError, UnsupportedOperationError
            As :func:`set_kernel_policy` (nothing in the model is changed then).
        BackendUnavailableError
            A ``strict`` policy where Triton is not installed.

        Examples
        --------
        >>> report = xpt.optimize(model, {"kernels": {"layernorm": "fused"}})   # doctest: +SKIP
        >>> print(report)                                                      # doctest: +SKIP
        >>> report.revert()                                                    # doctest: +SKIP
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
    _OPTIMIZED[model] = report
    run = Run(model, report, filter)
    patterns = [pattern for pattern in MODULE_PATTERNS if pattern.enabled(run)]
    with weights_left_as_they_are(model):
        for path, parent, name, module in _children(model):
            if not run.chosen(module, path):
                run.skip(path, "the filter refused it: left as written")
                continue
            for pattern in patterns:
                if pattern.apply(run, path, parent, name, module):
                    break  # settled: no later pattern looks at this module
        for pattern in MODEL_PATTERNS:
            if pattern.enabled(run):
                pattern.apply_model(run)
    report.attention = _attention_routing(get_kernel_policy())
    report.triton_missing = _triton_missing(model)
    return report


def _triton_missing(model: nn.Module) -> tuple[str, str] | None:
    """(device, why) where the device of the model's parameters cannot run our Triton
    kernels (None where it can, or the parameters are on several devices or none)."""
    from ..ops._launch import triton_unavailable

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

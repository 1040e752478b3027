"""optimize(model, policy): put our policy-routed modules in a model, reversibly, and say
what was replaced, what was not and why."""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..._errors import BackendUnavailableError, InvalidInputError
from ...policies import KernelPolicy
from .. import nn as routed
from .._functional._linear import linear_act, register_linear_act
from .._functional._projections import joined_halves, projections
from .._functional._residual import residual_norm
from .._selection._policy import clear_kernel_policy, get_kernel_policy, set_kernel_policy
from ..ops._launch import _TRITON_INSTALLED
from ._recognise import (
    ROPE_FUNCTION,
    gated_mlp_match,
    gelu_form,
    linear_kind,
    rewritten_forward,
    rms_norm_match,
    rope_attention_match,
)

__all__ = ["OptimizationReport", "optimize"]

_COMPILED_NOT_REWRITTEN = (
    "not fused: the model is already torch.compile'd, so its forwards are left as "
    "written; optimize the eager model and compile it after (make_train_step(..., "
    "compile_model=True) does both)"
)


@dataclass
class OptimizationReport:
    """What :func:`optimize` changed in a model, and how to undo it.

    Attributes
    ----------
    replaced : list of (str, str, str)
        (module path, original class, new class) for each module replaced.
    skipped : list of (str, str)
        (module path, reason) for each module considered and left alone.
    fused_residuals : list of str
        The norms whose input residual add now runs fused with them (the policy's
        ``residual_layernorm`` op, or ``residual_rmsnorm`` in decoder layers whose
        forward is bound on the instance), by path.
    fused_gelus : list of str
        The linear layers whose GELU now runs fused with them (the policy's
        ``linear_gelu`` op), by path.
    fused_mlps : list of str
        The first linear layers of the MLPs (linear, GELU, linear) that now run as one
        op (the policy's ``mlp`` op), by path.
    fused_swiglus : list of str
        The SwiGLU MLPs (``down(silu(gate(x)) * up(x))``, recognised by what they
        compute) whose activation now runs as the policy's ``swiglu`` op, by path; their
        forward is bound on the instance (the class and other models are untouched).
    fused_geglus : list of str
        Likewise the GeGLU MLPs (``down(gelu_tanh(gate(x)) * up(x))``, Gemma's), whose
        activation now runs as the policy's ``geglu`` op.
    fused_ropes : list of str
        The attention modules whose rotary embedding (their modeling file's
        ``apply_rotary_pos_emb``, recognised by what it computes) now runs as the
        policy's ``rope`` op, by path; their forward is bound on the instance.
    joined_projections : list of str
        Linear layers that take one input and now run as the policy's ``projections``
        op (one GEMM where it picks ``fused``), as ``"<module path>: q_proj, k_proj,
        v_proj"``; their module's forward is bound on the instance.
    attention : str
        How the model's attention is routed under the policy.
    policy : KernelPolicy or None
        The policy set by :func:`optimize` (None when it was called without one).
    """

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    fused_residuals: list[str] = field(default_factory=list)
    fused_gelus: list[str] = field(default_factory=list)
    fused_mlps: list[str] = field(default_factory=list)
    fused_swiglus: list[str] = field(default_factory=list)
    fused_geglus: list[str] = field(default_factory=list)
    fused_ropes: list[str] = field(default_factory=list)
    joined_projections: list[str] = field(default_factory=list)
    attention: str = ""
    policy: KernelPolicy | None = None
    _undo: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)
    _bound: list[nn.Module] = field(default_factory=list, repr=False)  # instance forwards
    _undo_forwards: Callable[[], None] | None = field(default=None, repr=False)
    _previous_policy: KernelPolicy | None = field(default=None, repr=False)
    _reverted: bool = field(default=False, repr=False)

    def revert(self) -> None:
        """Put every original module back, and the kernel policy from before."""
        if self._reverted:
            return
        if self._undo_forwards is not None:
            self._undo_forwards()
        for module in self._bound:
            module.__dict__.pop("forward", None)  # the class's forward again
        for parent, name, original in reversed(self._undo):
            setattr(parent, name, original)
        if self.policy is not None:
            if self._previous_policy is None:
                clear_kernel_policy()
            else:
                set_kernel_policy(self._previous_policy)
        self._reverted = True

    def __str__(self) -> str:
        lines = [
            f"replaced {len(self.replaced)} module(s), fused {len(self.fused_residuals)} "
            f"residual add(s), {len(self.fused_gelus)} GELU(s), {len(self.fused_mlps)} "
            f"MLP(s), {len(self.fused_swiglus)} SwiGLU(s), {len(self.fused_geglus)} GeGLU(s) "
            f"and {len(self.fused_ropes)} rotary embedding(s), joined "
            f"{len(self.joined_projections)} projection group(s), skipped {len(self.skipped)}"
        ]
        lines += [f"  {path}: {old} -> {new}" for path, old, new in self.replaced]
        lines += [f"  {path}: runs with the residual add before it (fused where the "
                  "add's operands have one shape)" for path in self.fused_residuals]  # fmt: skip
        lines += [f"  {path}: runs with the GELU after it" for path in self.fused_gelus]
        lines += [
            f"  {path}: runs with its MLP's GELU and second layer" for path in self.fused_mlps
        ]
        lines += [f"  {path}: its SwiGLU runs as one op" for path in self.fused_swiglus]
        lines += [f"  {path}: its GeGLU runs as one op" for path in self.fused_geglus]
        lines += [f"  {path}: its rotary embedding runs as one op" for path in self.fused_ropes]
        lines += [f"  {group}: run as one op" for group in self.joined_projections]
        lines += [f"  {path}: skipped, {why}" for path, why in self.skipped]
        lines.append(f"attention: {self.attention}")
        return "\n".join(lines)


def optimize(
    model: nn.Module,
    policy: KernelPolicy | Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> OptimizationReport:
    """Replace a model's norms by our policy-routed modules and apply ``policy``.

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

    Returns
    -------
    OptimizationReport
        What was replaced, what was skipped and why, how attention is routed; its
        ``revert()`` undoes everything.

    Raises
    ------
    InvalidInputError
        ``model`` is not an ``nn.Module``.
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
    report = OptimizationReport()
    if policy is not None:
        report._previous_policy = get_kernel_policy()
        report.policy = set_kernel_policy(policy)
    policy_in_force = get_kernel_policy()
    # Bound unless the policy names PyTorch's expression: under auto, as the norms, the
    # op decides per call (the bound forward runs PyTorch's expression where it picks it).
    named = policy_in_force.get if policy_in_force is not None else (lambda op: None)
    if not _TRITON_INSTALLED:
        named = _without_triton(report, policy_in_force)
    heads = _lm_heads(model) if _TRITON_INSTALLED else {}
    linears = policy_in_force is not None and policy_in_force.get("linear") is not None
    gated = {op for op in ("swiglu", "geglu") if named(op) != "torch"}
    ropes = named("rope") != "torch"
    residuals = {op for op in ("residual_rmsnorm", "residual_layernorm") if named(op) != "torch"}
    # Pairs the torch.fx rewrite takes (nn.Linear and nn.GELU, when the policy names
    # linear_gelu or mlp) are left to it.
    traced = frozenset(op for op in ("linear_gelu", "mlp") if named(op) not in (None, "torch"))
    acts = named("linear_gelu") != "torch"
    # Each module's RMSNorm probe, once: a decoder layer's binding asks of its norms
    # before they are visited and replaced.
    norm_match = functools.lru_cache(maxsize=None)(rms_norm_match)
    # Layers the linear op routes (a policy naming a linear kernel) stay that op's.
    joins = named("projections") != "torch" and not linears
    for path, parent, name, module in _children(model):
        if gated and (match := gated_mlp_match(module)) is not None:
            names, why, op = match
            if names is None:
                report.skipped.append((path, f"{type(module).__name__} {why}"))
            elif op not in gated:
                report.skipped.append(
                    (path, f"{type(module).__name__} {why}; the policy names no {op} kernel")
                )
            else:
                _bind_gated(module, op, *names, joins)
                report._bound.append(module)
                (report.fused_swiglus if op == "swiglu" else report.fused_geglus).append(path)
                if joins and names[1]:
                    report.joined_projections.append(f"{path}: {names[0]}, {names[1]}")
        helpers: dict[str, Callable[..., Any]] = {}
        if residuals:
            helpers["residual"] = residual_norm
        if acts and not (traced and _traced_by_fx(module, traced)):
            helpers["linear_act"] = linear_act
        if joins:
            helpers["projections"] = projections
        rope = None
        if ropes and (match := rope_attention_match(module, _rope_in_place_of)) is not None:
            rope, why = match
            if rope is None:
                report.skipped.append((path, f"{type(module).__name__}: {why}"))
        _bind_rewritten(report, path, module, helpers, rope, residuals, norm_match)
        kind = type(module).__name__
        if path in heads:
            _replace_head(report, path, parent, name, module, heads[path])
            continue
        if isinstance(module, (routed.LayerNorm, routed.RMSNorm, routed.Linear)):
            continue
        if type(module) is nn.Linear and linears:
            new: nn.Module = routed.Linear.from_linear(module)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and _own_forward(module):
            report.skipped.append(
                (path, f"{kind} overrides the forward of "
                 f"{'LayerNorm' if isinstance(module, nn.LayerNorm) else 'RMSNorm'}; its "
                 "computation is left as written")
            )  # fmt: skip
            continue
        elif isinstance(module, nn.LayerNorm):
            new = routed.LayerNorm.from_layernorm(module)
        elif isinstance(module, nn.RMSNorm):
            new = routed.RMSNorm.from_module(module)
        elif (match := norm_match(module)) is not None:
            eps, why, offset = match
            if eps is None:
                report.skipped.append((path, f"{kind} {why}"))
                continue
            new = routed.RMSNorm.from_module(module, eps=eps, weight_offset=offset)
        elif "Norm" in kind:
            report.skipped.append((path, f"{kind}: only LayerNorm and RMSNorm kinds are replaced"))
            continue
        elif isinstance(module, nn.MultiheadAttention):
            report.skipped.append(
                (path, "nn.MultiheadAttention runs PyTorch's attention kernels itself; "
                 "its SDPA call follows the policy's switches")
            )  # fmt: skip
            continue
        else:
            continue
        _refuse_sharded(path, module)
        setattr(parent, name, new)
        report._undo.append((parent, name, module))
        report.replaced.append((path, kind, f"xpt.nn.{type(new).__name__}"))
    if policy_in_force is not None:
        from ._rewrite import REWRITTEN_OPS, rewrite_forwards

        ops = [op for op in REWRITTEN_OPS if named(op) not in (None, "torch")]
        if ops and hasattr(model, "_orig_mod"):  # torch.compile's wrapper
            report.skipped.append(("<model>", f"{' and '.join(ops)} {_COMPILED_NOT_REWRITTEN}"))
        elif ops:
            fused, skipped, report._undo_forwards = rewrite_forwards(model, ops)
            report.fused_residuals += fused.get("residual_layernorm", [])
            report.fused_gelus += fused.get("linear_gelu", [])
            report.fused_mlps += fused.get("mlp", [])
            report.skipped += skipped
    report.attention = _attention_routing(get_kernel_policy())
    return report


# The ops whose fusions need Triton: their patterns import its kernels' modules.
_TRITON_PATTERNS = (
    "swiglu", "geglu", "rope", "residual_rmsnorm", "residual_layernorm", "linear_gelu", "mlp",
    "projections", "cross_entropy",
)  # fmt: skip


def _without_triton(
    report: OptimizationReport, policy: KernelPolicy | None
) -> Callable[[str], str | None]:
    """Without Triton (a CPU-only PyTorch install, macOS): the fusions are left as
    written and the report says so; the norms are still replaced, and run PyTorch's
    kernels. Under ``strict`` that is an error instead."""
    why = "Triton is not installed (pip install triton)"
    if policy is not None and policy.strict:
        raise BackendUnavailableError(
            f"optimize: {why}; the fused ops ({', '.join(_TRITON_PATTERNS)}) cannot run "
            "(strict mode, so nothing is left as written silently)"
        )
    report.skipped.append(
        ("<model>", f"{why}: {', '.join(_TRITON_PATTERNS)} left as written; the norms run "
         "PyTorch's kernels")
    )  # fmt: skip
    named = policy.get if policy is not None else (lambda op: None)
    return lambda op: "torch" if op in _TRITON_PATTERNS else named(op)


def _lm_heads(model: nn.Module) -> dict[str, str]:
    """Path -> why it is taken for a language-model head: an ``nn.Linear`` named
    ``lm_head`` or tied to an ``nn.Embedding`` of the model."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {}
    for path, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if path.rsplit(".", 1)[-1] == "lm_head":
            heads[path] = "named lm_head"
        elif id(module.weight) in embeddings:
            heads[path] = "its weight is tied to an embedding"
    return heads


def _replace_head(report, path, parent, name, module, why) -> None:
    from .._functional._lm_head import LinearCrossEntropyHead

    policy = get_kernel_policy()
    if policy is not None and policy.get("cross_entropy") == "torch":
        report.skipped.append((path, "the policy's cross_entropy is 'torch'"))
        return
    _refuse_sharded(path, module)
    setattr(parent, name, LinearCrossEntropyHead(module))
    report._undo.append((parent, name, module))
    report.replaced.append((path, f"Linear ({why})", "LinearCrossEntropyHead"))


def _refuse_sharded(path: str, module: nn.Module) -> None:
    """FSDP2 swaps unsharded parameters into the modules it was given at each forward:
    a module put in their place afterwards would compute with the shards."""
    if any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False)):
        from ..._errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"{path}: its parameters are already sharded by fully_shard (FSDP2), which "
            "swaps parameters into the modules it wrapped; apply the policy first "
            "(xpt.optimize(model, policy)), then fully_shard, then build the optimizer"
        )


def _children(model: nn.Module):
    """(path, parent, attribute name, module) for every submodule, each once."""
    seen: set[int] = set()
    for parent_path, parent in model.named_modules():
        for name, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            yield (f"{parent_path}.{name}" if parent_path else name), parent, name, child


def _own_forward(module: nn.Module) -> bool:
    """Whether a LayerNorm or RMSNorm subclass computes something else in its forward."""
    return type(module).forward not in (nn.LayerNorm.forward, nn.RMSNorm.forward)


def _bind_gated(module: nn.Module, op: str, gate: str, up: str, down: str, join: bool) -> None:
    """Give ``module`` (one instance) a forward whose activation is the policy's ``op``
    (``swiglu`` or ``geglu``); ``up`` empty: ``gate``'s output holds gate and up as its
    two halves. With ``join``, gate and up run as the policy's ``projections`` op, and
    where it gives the halves of one output, the activation takes that output whole
    (packed: neither direction copies a half). Its children are read at each call, so
    that a layer swapped in later (a LoRA wrapper, our routed Linear) is the one that
    runs."""
    from .._functional import _activations

    activation = getattr(_activations, op)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, down)(activation(getattr(self, gate)(x), getattr(self, up)(x)))

    def joined(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        g, u = projections(x, getattr(self, gate), getattr(self, up))
        packed = joined_halves(g, u)
        h = activation(g, u) if packed is None else activation(packed)
        return getattr(self, down)(h)

    def packed(self: nn.Module, x: torch.Tensor) -> torch.Tensor:  # gate_up's two halves
        return getattr(self, down)(activation(getattr(self, gate)(x)))

    bound = (joined if join else forward) if up else packed
    module.forward = types.MethodType(bound, module)


def _traced_by_fx(module: nn.Module, ops: frozenset[str]) -> bool:
    from ._rewrite import calls

    return calls(module, ops)


def _bind_rewritten(
    report: OptimizationReport,
    path: str,
    module: nn.Module,
    helpers: dict[str, Callable[..., Any]],
    rope: Callable[..., Any] | None,
    residuals: set[str],
    norm_match: Callable[[nn.Module], Any],
) -> None:
    """Bind on ``module`` a copy of its forward (:func:`rewritten_forward`) whose
    statements of each kind in ``helpers`` call it, and that calls ``rope`` for
    ``apply_rotary_pos_emb``, where any of it is worth it: a residual add before one of
    our norms (run as the ``residual_rmsnorm`` / ``residual_layernorm`` op), a linear
    layer (or a Conv1D) and a GELU module, by probe (the ``linear_gelu`` op), plain
    linear layers of one input width (the ``projections`` op), the rotary embedding
    (the ``rope`` op). The helpers run anything else as written."""
    match = rewritten_forward(module, helpers, {ROPE_FUNCTION: rope} if rope else None)
    if match is None:
        return
    forward, found = match
    fused = [
        norm
        for (norm,) in found.get("residual", [])
        if _residual_op(getattr(module, norm), norm_match) in residuals
    ]
    gelus = []
    for layer_name, act_name in found.get("linear_act", []):
        layer, act = getattr(module, layer_name), getattr(module, act_name)
        kind, form = linear_kind(layer), gelu_form(act)
        if kind is not None and form is not None:
            register_linear_act(layer, kind, act, form)
            gelus.append(layer_name)
    groups = [
        names
        for names in found.get("projections", [])
        if all(type(getattr(module, n)) is nn.Linear for n in names)
        and len({getattr(module, n).in_features for n in names}) == 1
    ]
    if not (fused or gelus or groups or rope):
        return
    module.forward = types.MethodType(forward, module)
    report._bound.append(module)
    report.fused_residuals += [f"{path}.{norm}" for norm in fused]
    report.fused_gelus += [f"{path}.{name}" for name in gelus]
    report.joined_projections += [f"{path}: {', '.join(names)}" for names in groups]
    if rope:
        report.fused_ropes.append(path)


def _residual_op(module: nn.Module, norm_match: Callable[[nn.Module], Any]) -> str | None:
    """The op that runs a residual add with ``module`` after it: ``residual_rmsnorm``
    where ``module`` is (or will be replaced by) our RMSNorm, ``residual_layernorm`` for
    our LayerNorm, else None (``norm_match``: :func:`rms_norm_match`, remembered per
    module)."""
    if isinstance(module, routed.RMSNorm):
        return "residual_rmsnorm"
    if isinstance(module, routed.LayerNorm):
        return "residual_layernorm"
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        if _own_forward(module):
            return None
        return "residual_rmsnorm" if isinstance(module, nn.RMSNorm) else "residual_layernorm"
    match = norm_match(module)
    return "residual_rmsnorm" if match is not None and match[0] is not None else None


@functools.cache
def _rope_in_place_of(original: Callable[..., Any], interleaved: bool) -> Callable[..., Any]:
    """What an optimized attention calls in place of its modeling file's
    ``apply_rotary_pos_emb`` (``original``): the policy's ``rope`` op on the calls it
    takes (q and k as (batch, heads, tokens, head_dim), ``unsqueeze_dim=1``, angles
    without gradients), ``original`` on any other. One per original function, which
    every layer of a model (and every model of that modeling file) shares."""
    from .._functional._rope import rope

    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, **kwargs: Any):
        unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if (
            unsqueeze != 1
            or len(args) + len(kwargs) > 1
            or (kwargs and "unsqueeze_dim" not in kwargs)
            or q.dim() != 4
            or cos.dim() != 3
            or cos.shape[-1] != q.shape[-1]
            or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        ):
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin, interleaved)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


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
    return (
        f"F.scaled_dot_product_attention and ops.fused_attention calls run {choice} "
        "(PyTorch's SDPA switches are set by the policy)"
    )

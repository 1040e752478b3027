"""The policy's ``residual_layernorm`` op: a residual add and the layer norm of its sum.

A pre-norm transformer adds each block's output to the residual stream and normalises the
sum for the next block (``x = x + attn(ln_1(x)); h = ln_2(x)``); the add and the norm are
separate modules' work, so only a rewrite of the model's forward can fuse them.
:func:`fuse_residual_norms` (called by ``optimize`` when the policy names the op) traces
the forwards that call LayerNorm modules with ``torch.fx``, and replaces each
``norm(a + b)`` whose sum is also used elsewhere by :func:`residual_layer_norm`, which
runs :func:`ops.fused_add_layernorm` or the add and the norm as before, as the policy
decides per call signature.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from ._context import ResidualNormContext
from ._kernels import NORM_ORDER
from ._norms import _emitted_dtype
from ._policy import _per_call, resolve_per_call, traced_choice
from ._timing import time_training_call

__all__ = ["fuse_residual_norms", "residual_layer_norm"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled
_ADDS = (operator.add, torch.add)


def residual_layer_norm(
    input: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input + branch, norm(input + branch))``, in one fused kernel or as the add and
    the norm module, as the policy's ``residual_layernorm`` op decides."""
    if (
        isinstance(input, torch.Tensor) and isinstance(branch, torch.Tensor)
        and input.shape == branch.shape and _choose(input, branch, norm) == "fused"
    ):  # fmt: skip
        from .ops.fused_add_layernorm import fused_add_layernorm

        return fused_add_layernorm(
            input, branch, norm.normalized_shape, norm.weight, norm.bias, norm.eps,
            out_dtype=_emitted_dtype(input),
        )  # fmt: skip
    h = input + branch
    return h, norm(h)


def _choose(input: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm) -> str:
    if torch.compiler.is_compiling():
        return traced_choice("residual_layernorm", input.device)
    grad = _grad_enabled() and (input.requires_grad or branch.requires_grad)
    signature = (
        input.shape, input.dtype, branch.shape, branch.dtype, input.device,
        norm.normalized_shape, norm.weight is None, norm.bias is None, grad, _deterministic(),
    )  # fmt: skip
    decision = _per_call["residual_layernorm"].get(signature)
    if decision is None:
        ctx = ResidualNormContext(
            input, tuple(norm.normalized_shape), norm.weight is not None,
            norm.bias is not None, _deterministic(), branch,
        )  # fmt: skip
        decision = resolve_per_call(
            "residual_layernorm", signature, ctx, NORM_ORDER,
            lambda kernel: _time(kernel.name, ctx, norm),
        )  # fmt: skip
    return decision.chosen


def _time(name: str, ctx: ResidualNormContext, norm: nn.LayerNorm) -> float:
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    y = torch.randn_like(ctx.branch).requires_grad_(ctx.requires_grad)
    twin = copy.deepcopy(norm)  # the timed backward must not touch the model's gradients
    leaves = [x, y, *twin.parameters()]

    def run():
        if name == "fused":
            from .ops.fused_add_layernorm import fused_add_layernorm

            return fused_add_layernorm(
                x, y, twin.normalized_shape, twin.weight, twin.bias, twin.eps,
                out_dtype=_emitted_dtype(x),
            )[1]  # fmt: skip
        return twin(x + y)

    return time_training_call(run, leaves, ctx.device, backward=ctx.requires_grad)


# -- the rewrite -------------------------------------------------------------------------------
def fuse_residual_norms(model: nn.Module) -> tuple[list[str], list[tuple[str, str]], Callable]:
    """Rewrite the forwards of ``model`` that compute ``norm(a + b)`` with the sum used
    again, so that :func:`residual_layer_norm` computes the pair.

    A module is traced when it calls LayerNorm children (directly or in a ModuleList or
    Sequential); the modules it calls that hold no LayerNorm stay opaque. Where the
    outermost such forward cannot be traced, its submodules are tried. Only forwards
    whose arguments are all required and positional are rewritten: tracing freezes
    optional ones.

    Returns
    -------
    (fused, skipped, undo)
        ``fused``: the paths of the norms whose input add is now fused into them (where
        the add's operands have one shape: a broadcasting add runs as written);
        ``skipped``: (module path, why); ``undo()`` puts every original forward back.
    """
    fused: list[str] = []
    skipped: list[tuple[str, str]] = []
    rewritten: list[nn.Module] = []
    _rewrite(model, "", fused, skipped, rewritten)

    def undo() -> None:
        for module in rewritten:
            module.__dict__.pop("forward", None)

    return fused, skipped, undo


def _rewrite(module, path, fused, skipped, rewritten) -> None:
    if _calls_norms(module):
        why = _untraceable(module)
        graph = None
        if why is None:
            try:
                graph, why = _trace(module)
            except Exception as e:  # fx raises many kinds; the reason is reported
                why = f"its forward cannot be traced by torch.fx ({type(e).__name__}: {e})"
        if graph is not None:
            norms = _fuse(module, graph)
            if norms:
                module.__dict__["forward"] = fx.GraphModule(module, graph).forward
                rewritten.append(module)
                fused += [f"{path}.{norm}" if path else norm for norm in norms]
            return
        skipped.append((path or "<model>", f"residual add + layer norm not fused: {why}"))
    for name, child in module.named_children():
        _rewrite(child, f"{path}.{name}" if path else name, fused, skipped, rewritten)


def _calls_norms(module: nn.Module) -> bool:
    """Whether ``module``'s own forward calls a LayerNorm (a child, or one in a child
    ModuleList or Sequential)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    for child in module.children():
        if isinstance(child, nn.LayerNorm):
            return True
        if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            if any(isinstance(c, nn.LayerNorm) or _calls_norms(c) for c in child.children()):
                return True
    return False


def _plain_layer_norm(module: nn.Module) -> bool:
    """A LayerNorm whose forward is layer normalisation (not a subclass that changes it)."""
    from .ops import FusedLayerNorm

    return type(module).forward in (nn.LayerNorm.forward, FusedLayerNorm.forward)


def _untraceable(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return "its forward has no signature to trace"
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or (p.default is not p.empty):
            return (
                f"its forward takes {p.name!r} as an optional or variadic argument, which "
                "tracing would freeze"
            )
    return None


def _trace(module: nn.Module) -> tuple[fx.Graph | None, str | None]:
    """The module's forward as a graph, or why it cannot be frozen into one. A graph
    holds one branch of each Python ``if``: the forward is traced in training and in
    eval mode, and refused when the two differ (it branches on ``self.training``)."""
    modes = {m: m.training for m in module.modules()}
    try:
        graphs = []
        for training in (True, False):
            module.train(training)
            graphs.append(_Tracer().trace(module))
    finally:
        for m, training in modes.items():
            m.training = training
    if graphs[0].python_code("self").src != graphs[1].python_code("self").src:
        return None, "its forward branches on self.training, which tracing would freeze"
    return graphs[0], None


class _Tracer(fx.Tracer):
    """Traces into the modules that call LayerNorms; every other module is one node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not _calls_norms(m)


def _fuse(module: nn.Module, graph: fx.Graph) -> list[str]:
    """Replace each ``norm(a + b)`` whose sum has other users; return the norms' paths."""
    norms = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        if not _plain_layer_norm(module.get_submodule(node.target)):
            continue
        add = node.args[0]
        if not (
            isinstance(add, fx.Node) and add.op == "call_function" and add.target in _ADDS
            and len(add.args) == 2 and not add.kwargs and len(add.users) > 1
            and all(isinstance(a, fx.Node) for a in add.args)
        ):  # fmt: skip
            continue
        with graph.inserting_after(add):
            norm = graph.get_attr(node.target)
        with graph.inserting_after(norm):
            pair = graph.call_function(residual_layer_norm, (*add.args, norm))
        with graph.inserting_after(pair):
            total = graph.call_function(operator.getitem, (pair, 0))
        with graph.inserting_after(total):
            normed = graph.call_function(operator.getitem, (pair, 1))
        node.replace_all_uses_with(normed)
        graph.erase_node(node)
        add.replace_all_uses_with(total)
        graph.erase_node(add)
        norms.append(node.target)
    graph.lint()
    return norms

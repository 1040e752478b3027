"""torch.fx rewrites of a model's forwards, for fusions that span modules.

Three patterns, each applied when the policy names its op (``optimize`` calls
:func:`rewrite_forwards`):

``residual_layernorm``
    ``norm(a + b)`` whose sum is used again (a pre-norm residual stream) becomes
    :func:`._residual.residual_layer_norm`: the add and the norm in one fused kernel.
``mlp``
    ``linear2(gelu(linear1(x)))`` whose intermediate outputs have no other user (a
    transformer's MLP) becomes :func:`._linear.mlp`: GELU and its derivative in the
    GEMMs' epilogues. Matched before ``linear_gelu``, which takes what is left.
``linear_gelu``
    ``gelu(linear(x))`` whose linear output feeds the GELU alone becomes
    :func:`._linear.linear_gelu`: GELU's backward and the bias gradient in one pass.

The GELU is an ``nn.GELU`` module, or an ``F.gelu`` call in a forward traced for any
pattern (a forward is traced for the last two when it calls an ``nn.GELU``).

Each rewritten pair is then decided per call signature, as its op says.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import nn as routed
from .._functional._linear import linear_gelu, mlp
from .._functional._residual import residual_layer_norm
from ._probes import gelu_form

__all__ = ["REWRITTEN_OPS", "calls", "rewrite_forwards"]

REWRITTEN_OPS = ("residual_layernorm", "mlp", "linear_gelu")
_ADDS = (operator.add, torch.add)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def rewrite_forwards(
    model: nn.Module,
    ops: Collection[str],
    chosen: Callable[[nn.Module, str], bool] = lambda module, path: True,
) -> tuple[dict[str, list[str]], list[tuple[str, str]], Callable]:
    """Rewrite the forwards of ``model`` where the patterns of ``ops`` (some of
    :data:`REWRITTEN_OPS`) occur.

    A module is traced when its own forward calls modules a pattern starts from (a
    LayerNorm; a Linear and a GELU), directly or in a ModuleList, Sequential or
    ModuleDict; the modules it calls that hold none stay opaque. Where the outermost
    such forward cannot be traced, or ``chosen(module, path)`` is False, its submodules
    are tried. Only forwards whose
    arguments are all required and positional are rewritten: tracing freezes optional
    ones.

    Returns
    -------
    (fused, skipped, undo)
        ``fused``: op -> the paths of the modules whose pair now runs through it (the
        norms after a residual add, where the add's operands have one shape: a
        broadcasting add runs as written; the linear layers before a GELU, for an MLP
        its first);
        ``skipped``: (module path, why); ``undo()`` puts every original forward back.
    """
    ops = frozenset(ops)
    fused: dict[str, list[str]] = {op: [] for op in ops}
    skipped: list[tuple[str, str]] = []
    rewritten: list[nn.Module] = []
    _rewrite(model, "", ops, fused, skipped, rewritten, chosen)

    def undo() -> None:
        for module in rewritten:
            module.__dict__.pop("forward", None)

    return fused, skipped, undo


def _rewrite(module, path, ops, fused, skipped, rewritten, chosen) -> None:
    if calls(module, ops) and chosen(module, path):
        why = _untraceable(module)
        graph = None
        if why is None:
            try:
                graph, why = _trace(module, ops)
            except Exception as e:  # fx raises many kinds; the reason is reported
                why = f"its forward cannot be traced by torch.fx ({type(e).__name__}: {e})"
        if graph is not None:
            found = {op: _PATTERNS[op](module, graph, ops) for op in REWRITTEN_OPS if op in ops}
            graph.lint()
            if any(found.values()):
                module.__dict__["forward"] = fx.GraphModule(module, graph).forward
                rewritten.append(module)
                for op, targets in found.items():
                    fused[op] += [f"{path}.{t}" if path else t for t in targets]
            return
        skipped.append((path or "<model>", f"{' and '.join(sorted(ops))} not fused: {why}"))
    for name, child in module.named_children():
        _rewrite(child, f"{path}.{name}" if path else name, ops, fused, skipped, rewritten, chosen)


def calls(module: nn.Module, ops: frozenset[str]) -> bool:
    """Whether ``module``'s own forward calls modules a pattern of ``ops`` starts from
    (children, or in child containers)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    children = []
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            if any(calls(c, ops) for c in child.children()):
                return True
            children += child.children()
        else:
            children.append(child)
    if "residual_layernorm" in ops and any(isinstance(c, nn.LayerNorm) for c in children):
        return True
    return bool({"linear_gelu", "mlp"} & ops) and (
        any(isinstance(c, nn.Linear) for c in children)
        and any(isinstance(c, nn.GELU) for c in children)
    )


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


def _trace(module: nn.Module, ops: frozenset[str]) -> tuple[fx.Graph | None, str | None]:
    """The module's forward as a graph, or why it cannot be frozen into one. A graph
    holds one branch of each Python ``if``: the forward is traced in training and in
    eval mode, and refused when the two differ (it branches on ``self.training``)."""
    modes = {m: m.training for m in module.modules()}
    try:
        graphs = []
        for training in (True, False):
            module.train(training)
            graphs.append(_Tracer(ops).trace(module))
    finally:
        for m, training in modes.items():
            m.training = training
    if graphs[0].python_code("self").src != graphs[1].python_code("self").src:
        return None, "its forward branches on self.training, which tracing would freeze"
    return graphs[0], None


class _Tracer(fx.Tracer):
    """Traces into the modules that call a pattern's modules; every other module is one
    node."""

    def __init__(self, ops: frozenset[str]) -> None:
        super().__init__()
        self.ops = ops

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not calls(m, self.ops)


def _plain(module: nn.Module, *kinds: type) -> bool:
    """A module of one of ``kinds`` (or our drop-in for it) whose forward is the
    kind's own (not a subclass that changes it)."""
    own = {nn.LayerNorm: routed.LayerNorm, nn.Linear: routed.Linear, nn.GELU: nn.GELU}
    return any(type(module).forward in (k.forward, own[k].forward) for k in kinds)


def _fuse_residual_norms(module: nn.Module, graph: fx.Graph, ops: frozenset[str]) -> list[str]:
    """Replace each ``norm(a + b)`` whose sum has other users; return the norms' paths."""
    norms = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        if not _plain(module.get_submodule(node.target), nn.LayerNorm):
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
    return norms


def _gelu_form(module: nn.Module, node: fx.Node) -> str | None:
    """The ``approximate`` of a GELU node (a module computing GELU, recognised as the
    statement engine recognises one: :func:`._probes.gelu_form`; or an ``F.gelu`` call
    on one tensor), else None."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        return gelu_form(module.get_submodule(node.target))
    if node.op == "call_function" and node.target is F.gelu and len(node.args) == 1:
        form = node.kwargs.get("approximate", "none")
        return form if set(node.kwargs) <= {"approximate"} and form in ("none", "tanh") else None
    return None


def _linear_node(module: nn.Module, node: object) -> bool:
    """Whether ``node`` calls a plain linear layer on one tensor and its output has one
    user."""
    return (
        isinstance(node, fx.Node) and node.op == "call_module" and len(node.args) == 1
        and not node.kwargs and len(node.users) == 1
        and _plain(module.get_submodule(node.target), nn.Linear)
    )  # fmt: skip


def _fuse_mlps(module: nn.Module, graph: fx.Graph, ops: frozenset[str]) -> list[str]:
    """Replace each ``linear2(gelu(linear1(x)))`` whose first layer's and GELU's outputs
    have no other user; return the first layers' paths."""
    layers = []
    for node in list(graph.nodes):
        if not (
            node.op == "call_module" and len(node.args) == 1 and not node.kwargs
            and _plain(module.get_submodule(node.target), nn.Linear)
        ):  # fmt: skip
            continue
        gelu = node.args[0]
        form = _gelu_form(module, gelu) if isinstance(gelu, fx.Node) else None
        if form is None or len(gelu.users) != 1 or not _linear_node(module, gelu.args[0]):
            continue
        fc = gelu.args[0]
        with graph.inserting_before(node):
            first, second = graph.get_attr(fc.target), graph.get_attr(node.target)
            args = (fc.args[0], first, second, form, "linear_gelu" in ops)
            out = graph.call_function(mlp, args)
        node.replace_all_uses_with(out)
        for done in (node, gelu, fc):
            graph.erase_node(done)
        layers.append(fc.target)
    return layers


def _fuse_linear_gelus(module: nn.Module, graph: fx.Graph, ops: frozenset[str]) -> list[str]:
    """Replace each ``gelu(linear(x))`` whose linear output has no other user; return
    the linear layers' paths."""
    layers = []
    for node in list(graph.nodes):
        form = _gelu_form(module, node)
        fc = node.args[0] if form is not None else None
        if not _linear_node(module, fc):
            continue
        with graph.inserting_before(node):
            layer = graph.get_attr(fc.target)
            pair = graph.call_function(linear_gelu, (fc.args[0], layer, form))
        node.replace_all_uses_with(pair)
        graph.erase_node(node)
        graph.erase_node(fc)
        layers.append(fc.target)
    return layers


_PATTERNS = {
    "residual_layernorm": _fuse_residual_norms,
    "mlp": _fuse_mlps,
    "linear_gelu": _fuse_linear_gelus,
}

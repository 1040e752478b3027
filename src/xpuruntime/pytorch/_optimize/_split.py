"""A forward split where it calls a child (the language-model head): while torch.compile
traces it for training, that call and every statement after it run outside the compiled
graph.

A compiled graph can only return computed tensors, so a model compiled whole returns
its logits computed (on Gemma3's 262k vocabulary at B4 x T2048: 4.3 GB in bf16, twice
that as the loss's fp32) and its loss computed from them. Split, the graph ends at the
hidden states; the head then returns deferred logits and the loss runs fused, without
them, as in eager (:mod:`.._functional._lm_head`). That costs one graph break, so the
split is taken only where it pays and dynamo may break the graph: with gradients off
(``generate``, which reads every logit it keeps), under ``fullgraph=True`` or in
``torch.export``, the forward traces whole, as written. Dynamo guards its trace on the
gradient mode, so each mode runs the trace made for it.

The copy of the forward is the class's own (through its decorators), its statements
from the one calling ``self.<child>(...)`` on moved into a function of their own, which
receives the forward's variables they read; its globals are the modeling file's.
"""

from __future__ import annotations

import ast
import functools
import types

import torch
from torch import nn

from ._functions import (
    class_forward,
    copy_function,
    function_code,
    module_namespace,
    parsed_source,
    rebuilt,
)

__all__ = ["split_forward"]

_COMPILING = "_xpuruntime_compiling"
_TRAINING = "_xpuruntime_grad_enabled"
_MAY_BREAK = "_xpuruntime_graph_may_break"
_OUTSIDE = "_xpuruntime_outside_the_graph"


def split_forward(module: nn.Module, child: str) -> types.FunctionType | None:
    """A copy of ``module``'s forward that, while dynamo traces it with gradients on
    (training: without them, as in ``generate``, the logits are all read anyway) and may
    break the graph, calls ``self.<child>`` and runs the statements from there on outside
    the compiled graph; as written otherwise. None where it cannot be split: the forward
    does not call ``self.<child>``, the statements from that call on read a variable the
    forward may not have set by then or act on its frame (``yield``, ``super()``), or
    the forward is bound on the instance already."""
    chain = class_forward(module, lambda f: child in f.__code__.co_names)
    if chain is None:
        return None
    inner = chain[-1]
    if inner.__code__.co_freevars:
        return None
    split = _split_code(inner.__code__.co_filename, inner.__code__, child)
    if split is None:
        return None
    code, rest_code = split
    rest_name = rest_code.co_name
    names = {_COMPILING: torch.compiler.is_compiling, _TRAINING: torch.is_grad_enabled,
             _MAY_BREAK: graph_may_break, _OUTSIDE: outside_the_graph}  # fmt: skip
    namespace = module_namespace(inner.__globals__, names)
    rest = namespace.get(rest_name)
    if getattr(rest, "__code__", None) is not rest_code:  # one function per split code
        namespace[rest_name] = types.FunctionType(rest_code, namespace, rest_name)
    function = copy_function(inner, namespace, inner.__closure__)
    function.__code__ = code
    return rebuilt(chain, function)


@functools.cache
def _split_code(
    filename: str, code: types.CodeType, child: str
) -> tuple[types.CodeType, types.CodeType] | None:
    """The split forward's code and that of the function its statements from the call
    of ``self.<child>`` on moved into; None where :func:`split_forward` says."""
    parsed = parsed_source(code)
    if parsed is None:
        return None
    tree, definition = parsed
    body = definition.body
    at = next((i for i, s in enumerate(body) if _calls_child(s, child)), None)
    if at is None:
        return None
    before, after = body[:at], body[at:]
    if any(isinstance(n, _REFUSED) for s in after for n in ast.walk(s)):
        return None
    arguments = [a.arg for a in _arguments(definition.args)]
    surely = set(arguments) | {n for s in before if _plain_assignment(s) for n in _stored(s)}
    maybe = {n for s in before for n in _stored(s)}
    read = _read(after)
    if any(n in maybe and n not in surely for n in read):
        return None  # set on some paths only: passed on, it could be unbound
    passed = [n for n in arguments if n in read] + sorted(
        n for n in read if n in surely and n not in arguments
    )
    rest_name = f"_xpuruntime_{code.co_qualname.replace('.', '_')}_from_{child}"
    rest = ast.FunctionDef(
        name=rest_name,
        args=ast.arguments([], [ast.arg(n) for n in passed], None, [], [], None, []),
        body=after,
        decorator_list=[],
        returns=None,
    )
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12 on
        rest.type_params = []
    call = ast.Call(
        ast.Name(_OUTSIDE, ast.Load()),
        [ast.Name(rest_name, ast.Load()), *(ast.Name(n, ast.Load()) for n in passed)],
        [],
    )
    test = ast.BoolOp(
        ast.And(),
        [ast.Call(ast.Name(name, ast.Load()), [], []) for name in (_COMPILING, _TRAINING, _MAY_BREAK)],
    )  # fmt: skip
    branch = ast.copy_location(ast.If(test, [ast.Return(call)], []), after[0])
    definition.body = [*before, branch, *after]
    tree.body.append(ast.copy_location(rest, after[0]))
    ast.fix_missing_locations(tree)
    split = function_code(tree, code)
    rest_code = function_code(tree, code, rest_name)
    if split is None or rest_code is None or split.co_freevars or rest_code.co_freevars:
        return None
    return split, rest_code


# What a moved statement cannot hold: it would act on the forward's frame, not its own.
_REFUSED = (ast.Yield, ast.YieldFrom, ast.Await, ast.Nonlocal, ast.Global)


def _calls_child(statement: ast.stmt, child: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == child
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        for n in ast.walk(statement)
    )


def _arguments(args: ast.arguments) -> list[ast.arg]:
    every = [*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg]
    return [a for a in every if a is not None]


def _plain_assignment(statement: ast.stmt) -> bool:
    """An assignment at the body's top level: its names are set whenever it ran."""
    if isinstance(statement, ast.AnnAssign):
        return statement.value is not None
    return isinstance(statement, (ast.Assign, ast.AugAssign))


def _stored(statement: ast.stmt) -> set[str]:
    """The names ``statement`` sets in the function's own scope (not a comprehension's,
    a lambda's or a nested function's)."""
    found, todo = set(), [statement]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)  # its body is a scope of its own
        elif not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))
    return found


_SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


def _read(statements: list[ast.stmt]) -> set[str]:
    return {
        n.id
        for s in statements
        for n in ast.walk(s)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


@torch._dynamo.assume_constant_result
def graph_may_break() -> bool:
    """Whether the trace dynamo is making may break its graph: not under
    ``fullgraph=True``, ``torch.export`` or ``error_on_graph_break``. Dynamo calls it
    while tracing and takes its result as a constant; False outside a trace and
    wherever dynamo's tracer cannot be asked. Dynamo keeps its traces per code object,
    not per compile call: a forward first traced split runs split under a later
    ``fullgraph=True`` compile of the same model class too (and one first traced whole
    runs whole), until ``torch._dynamo.reset()``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tracer = InstructionTranslator.current_tx()
        return not (tracer.one_graph or getattr(tracer, "error_on_graph_break", False))
    except Exception:  # not tracing, or a dynamo without these: trace whole, as written
        return False


@torch.compiler.disable
def outside_the_graph(function, *args):
    """``function(*args)``, run eagerly: dynamo breaks its graph at this call."""
    return function(*args)

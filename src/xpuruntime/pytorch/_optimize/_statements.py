"""Statement rewrites of a module's forward: a copy of the class forward, bound on the
instance alone, in which some statements call our ops.

A decoder layer whose forward adds a branch to its residual and normalises the sum in
three statements (``h = residual + h; residual = h; h = self.norm(h)``, Llama's and ~250
other modeling files') gets those three statements as one call of the residual-norm op,
which computes the same; the rest of the forward is unchanged. A forward whose
consecutive statements each call a child on the same input (Llama's ``self.q_proj(h)``,
``self.k_proj(h)``, ``self.v_proj(h)``) gets a copy that makes those calls once,
together, before the first of them (where they can run as one GEMM), and uses each
result where its call stood. A linear layer followed by its activation becomes one call.
"""

from __future__ import annotations

import ast
import copy
import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ._functions import (
    class_forward,
    copy_function,
    function_code,
    module_namespace,
    parsed_source,
    rebuilt,
)

__all__ = [
    "HEAD_NORMS_FUNCTION",
    "LINEAR_ACT_FUNCTION",
    "PROJECTIONS_FUNCTION",
    "RESIDUAL_FUNCTION",
    "rewritten_forward",
]

RESIDUAL_FUNCTION = "_xpuruntime_residual_norm"
"""The name the rewritten decoder forwards call the residual add and norm by."""


LINEAR_ACT_FUNCTION = "_xpuruntime_linear_act"
"""The name rewritten forwards call a linear layer and its activation by."""


PROJECTIONS_FUNCTION = "_xpuruntime_projections"
"""The name rewritten forwards call the children that take one input together by."""


HEAD_NORMS_FUNCTION = "_xpuruntime_head_norms"
"""The name rewritten attention forwards call the q/k norms and the rotary embedding by."""

ROPE_NAME = "apply_rotary_pos_emb"


# -- forwards rewritten ---------------------------------------------------------------------
_HELPERS = {
    "residual": RESIDUAL_FUNCTION,
    "linear_act": LINEAR_ACT_FUNCTION,
    "projections": PROJECTIONS_FUNCTION,
    "head_norms": HEAD_NORMS_FUNCTION,
}
"""Each kind of rewrite, and the name the rewritten statements call its helper by."""


def rewritten_forward(
    module: nn.Module,
    helpers: dict[str, Callable[..., Any]],
    names: dict[str, Any] | None = None,
) -> tuple[types.FunctionType, dict[str, list[tuple[str, ...]]]] | None:
    """A copy of ``module``'s forward (its class's, through its decorators) in which the
    statements of each kind in ``helpers`` call that helper, and whose globals have
    ``names`` set (our ``apply_rotary_pos_emb``); with the attribute names each rewritten
    run of statements involves, by kind. None where it would change nothing (no such
    statements and no ``names``, a forward bound on the instance already, or a source
    that cannot be read).

    The kinds, and what each helper must return:

    - ``"residual"``: ``h = a + b; kept = h; h = self.<norm>(h)`` (Llama's ``h = residual
      + h; residual = h``; ``a`` and ``b`` any expressions) is ``kept, h = helper(a, b,
      self.<norm>)``; with an ``if <name> is (not) None:`` between the add and the rest
      (GPT-2's cross-attention), so where that ``if`` would not run. The helper returns
      ``(a + b, norm(a + b))``.
    - ``"linear_act"``: ``h = self.<layer>(h); h = self.<act>(h)`` is ``h = helper(h,
      self.<layer>, self.<act>)``; the helper returns ``act(layer(h))``.
    - ``"projections"``: consecutive statements that each call one child on the same
      name ``x`` (and read ``x`` nowhere else, nor assign it) make those calls once,
      before the first, as ``helper(x, self.<a>, self.<b>, ...)``, and each statement
      uses its child's result where its call stood; the helper returns ``(a(x), b(x),
      ...)``.
    - ``"head_norms"``: ``q = <e>`` and ``k = <e'>``, each ``e`` being ``self.<qn>(x)``
      or ``self.<qn>(x).transpose(1, 2)``, then ``q, k = apply_rotary_pos_emb(q, k,
      ...)`` with neither name read or assigned between (Qwen3's and Gemma3's
      attention): the norm calls are dropped (``q = x.transpose(1, 2)``) and the rope
      statement is ``q, k = helper(apply_rotary_pos_emb, q, k, self.<qn>, self.<kn>,
      (tq, tk), ...)``, ``tq`` whether q's transpose followed its norm; the helper
      returns ``apply_rotary_pos_emb(qn(q), kn(k), ...)`` with each norm taken where it
      was (before the transpose where ``tq``).

    Whether the attributes are what a helper can fuse (a norm, a linear layer and a GELU,
    linear layers of one input) the caller judges; the helpers run any other module as
    written."""
    names = dict(names or {})
    kinds = tuple(kind for kind in _REWRITES if kind in helpers)  # in _REWRITES' order
    chain = class_forward(module, _rewritable) if kinds else None
    rewritten = None if chain is None else _rewrite_of(module, chain[-1], kinds)
    if rewritten is not None:
        code, found = rewritten
    elif names:
        chain = class_forward(module, lambda f: any(n in f.__code__.co_names for n in names))
        if chain is None:
            return None
        code, found = chain[-1].__code__, {}
    else:
        return None
    inner = chain[-1]
    names.update({_HELPERS[kind]: helpers[kind] for kind in found})
    function = copy_function(inner, module_namespace(inner.__globals__, names), inner.__closure__)
    function.__code__ = code
    return rebuilt(chain, function), found


def _rewrite_of(
    module: nn.Module, inner: types.FunctionType, kinds: tuple[str, ...]
) -> tuple[types.CodeType, dict[str, list[tuple[str, ...]]]] | None:
    """:func:`_rewritten_code` of ``inner`` by those of ``kinds`` whose statements call
    only ``module``'s child modules (a kind that calls anything else is left out); None
    where none remains."""
    while kinds:
        # Keyed by file too: code objects compare equal across files holding the same source.
        rewritten = _rewritten_code(inner.__code__.co_filename, inner.__code__, kinds)
        if rewritten is None:
            return None
        found = rewritten[1]
        usable = tuple(
            kind
            for kind, runs in found.items()
            if all(isinstance(getattr(module, n, None), nn.Module) for run in runs for n in run)
        )
        if usable == tuple(found):
            return rewritten
        kinds = usable
    return None


def _rewritable(function: types.FunctionType) -> bool:
    """A forward that may hold statements to rewrite: one taking ``self``, without free
    variables (its code compiles again on its own)."""
    code = function.__code__
    return code.co_argcount > 0 and code.co_varnames[0] == "self" and not code.co_freevars


@functools.cache
def _rewritten_code(
    filename: str, code: types.CodeType, kinds: tuple[str, ...]
) -> tuple[types.CodeType, dict[str, list[tuple[str, ...]]]] | None:
    """The code of the function ``code`` (from ``filename``) belongs to, with its
    statements of each of ``kinds`` rewritten (:func:`rewritten_forward`'s), and the
    attribute names each run involves, by kind (kinds that found none left out); None
    where it has none, or its source cannot be read and compiled again."""
    parsed = parsed_source(code)
    if parsed is None:
        return None
    tree, definition = parsed
    found: dict[str, list[tuple[str, ...]]] = {}
    for kind in kinds:
        runs: list[tuple[str, ...]] = []
        definition.body = _REWRITES[kind](definition.body, runs)
        if runs:
            found[kind] = runs
    if not found:
        return None
    rewritten = function_code(tree, code)
    if rewritten is None or rewritten.co_freevars != code.co_freevars:
        return None
    return rewritten, found


def _rewritten_body(
    body: list[ast.stmt], found: list[tuple[str, ...]], width: int, match: Callable[..., Any]
) -> list[ast.stmt]:
    """``body`` with each run of ``width`` statements that ``match`` takes as one
    assignment ``targets = function(*operands, *self.attributes)``, from ``match``'s
    ``(targets, function, operands, attributes)`` (an operand: a name, or an expression
    evaluated where the run's first statement evaluated it); each run's attributes
    appended to ``found``."""
    out: list[ast.stmt] = []
    i = 0
    while i < len(body):
        matched = match(body[i : i + width])
        if matched is None:
            out.append(body[i])
            i += 1
            continue
        targets, function, operands, attributes = matched
        args = [ast.Name(o, ast.Load()) if isinstance(o, str) else o for o in operands]
        args += [ast.Attribute(ast.Name("self", ast.Load()), a, ast.Load()) for a in attributes]
        stored = [ast.Name(name, ast.Store()) for name in targets]
        target = stored[0] if len(stored) == 1 else ast.Tuple(stored, ast.Store())
        call = ast.Call(ast.Name(function, ast.Load()), args, [])
        out.append(
            ast.fix_missing_locations(ast.copy_location(ast.Assign([target], call), body[i]))
        )
        found.append(tuple(attributes))
        i += width
    return out


def _residual_match(statements: list[ast.stmt]) -> tuple | None:
    """``kept, h = helper(a, b, self.<norm>)`` for a residual add-and-norm triple
    (:func:`_residual_triple`)."""
    triple = _residual_triple(statements)
    if triple is None:
        return None
    kept, hidden, operands, norm = triple
    return (kept, hidden), RESIDUAL_FUNCTION, operands, (norm,)


def _guarded_residuals(body: list[ast.stmt], found: list[tuple[str, ...]]) -> list[ast.stmt]:
    """``body`` with each residual triple that has an ``if`` on whether a name is None
    between its add and the rest (GPT-2's ``h = attn_output + residual``, its
    cross-attention block, ``residual = h; h = self.ln_2(h)``) as ``if <test>: <the four
    statements as written> else: kept, h = helper(a, b, self.<norm>)``: where the
    ``if`` would not run, the triple is the fused call. The test (a name compared with
    None by ``is`` or ``is not``, which the add does not assign) is evaluated first."""
    out: list[ast.stmt] = []
    i = 0
    while i < len(body):
        run = body[i : i + 4]
        guard = run[1] if len(run) == 4 else None
        triple = _residual_triple([run[0], *run[2:]]) if isinstance(guard, ast.If) else None
        if triple is None or guard.orelse or _none_test(guard.test) in (None, triple[1]):
            out.append(body[i])
            i += 1
            continue
        (fused,) = _rewritten_body(run[:1] + run[2:], [], 3, _residual_match)
        branch = ast.If(copy.deepcopy(guard.test), run, [fused])
        out.append(ast.fix_missing_locations(ast.copy_location(branch, run[0])))
        found.append((triple[3],))  # the norm
        i += 4
    return out


def _none_test(test: ast.expr) -> str | None:
    """The name ``test`` compares with None (``x is None``, ``x is not None``); else None."""
    if (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return test.left.id
    return None


def _residuals(body: list[ast.stmt], found: list[tuple[str, ...]]) -> list[ast.stmt]:
    """The residual rewrite: plain triples (:func:`_residual_match`), then guarded ones
    (:func:`_guarded_residuals`)."""
    return _guarded_residuals(_rewritten_body(body, found, 3, _residual_match), found)


def _pair_match(statements: list[ast.stmt]) -> tuple | None:
    """``h = helper(h, self.<a>, self.<b>)`` for ``h = self.<a>(h); h = self.<b>(h)``."""
    if len(statements) != 2:
        return None
    first, second = (_self_call(s) for s in statements)
    if first is None or second is None or first[0] != second[0]:
        return None
    return (first[0],), LINEAR_ACT_FUNCTION, (first[0],), (first[1], second[1])


def _self_call(statement: ast.stmt) -> tuple[str, str] | None:
    """(h, name) for ``h = self.<name>(h)``; else None."""
    if not _assigns_one_name(statement):
        return None
    hidden, call = statement.targets[0].id, statement.value
    if (
        not isinstance(call, ast.Call)
        or call.keywords
        or len(call.args) != 1
        or getattr(call.args[0], "id", None) != hidden
        or not isinstance(call.func, ast.Attribute)
        or getattr(call.func.value, "id", None) != "self"
    ):
        return None
    return hidden, call.func.attr


def _residual_triple(statements: list[ast.stmt]) -> tuple | None:
    """(kept, hidden, (a, b), norm) for ``hidden = a + b``, ``kept = hidden``, ``hidden =
    self.norm(hidden)``, where ``a`` and ``b`` are any expressions, evaluated as before and
    in the same order (Llama's ``h = residual + h; residual = h``, Granite's ``h =
    residual + h * self.residual_multiplier``, Phi-3's ``h = residual +
    self.resid_attn_dropout(h)``); else None."""
    if len(statements) != 3 or not all(_assigns_one_name(s) for s in statements):
        return None
    add, keep, normed = statements
    hidden = add.targets[0].id
    value = add.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return None
    kept = keep.targets[0].id
    if kept == hidden or getattr(keep.value, "id", None) != hidden:
        return None
    normalised = _self_call(normed)
    if normalised is None or normalised[0] != hidden:
        return None
    return kept, hidden, (value.left, value.right), normalised[1]


def _assigns_one_name(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    )


def _joined_calls(body: list[ast.stmt], found: list[tuple[str, ...]]) -> list[ast.stmt]:
    """``body`` with each run of two or more statements that call one child each on the
    same name (:func:`_child_call`) preceded by ``p0, p1, ... = helper(x, self.<a>,
    self.<b>, ...)`` and each call replaced by its result's name; each run's children
    appended to ``found``."""
    out: list[ast.stmt] = []
    i = 0
    while i < len(body):
        calls = []
        for statement in body[i:]:
            call = _child_call(statement)
            if call is None or (calls and (
                call[0] != calls[0][0] or call[1] in [c[1] for c in calls]
            )):  # fmt: skip
                break
            calls.append(call)
        if len(calls) < 2:
            out.append(body[i])
            i += 1
            continue
        name = calls[0][0]
        results = [f"_xpuruntime_projected_{len(found)}_{k}" for k in range(len(calls))]
        helper = ast.Call(
            ast.Name(PROJECTIONS_FUNCTION, ast.Load()),
            [ast.Name(name, ast.Load())]
            + [ast.Attribute(ast.Name("self", ast.Load()), c[1], ast.Load()) for c in calls],
            [],
        )
        stored = ast.Tuple([ast.Name(r, ast.Store()) for r in results], ast.Store())
        out.append(
            ast.fix_missing_locations(ast.copy_location(ast.Assign([stored], helper), body[i]))
        )
        for (_, _, node), result, statement in zip(calls, results, body[i:]):
            out.append(_ReplaceNode(node, result).visit(statement))
        found.append(tuple(c[1] for c in calls))
        i += len(calls)
    return out


def _child_call(statement: ast.stmt) -> tuple[str, str, ast.Call] | None:
    """``(x, name, call)`` where ``statement`` assigns an expression holding exactly one
    call ``self.<name>(x)`` of a plain name ``x`` that the statement reads nowhere else
    and does not assign; else None."""
    if not isinstance(statement, ast.Assign):
        return None
    stored = {n.id for t in statement.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    calls = [
        node
        for node in ast.walk(statement.value)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and getattr(node.func.value, "id", None) == "self"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Name)
    ]
    if len(calls) != 1:
        return None
    call = calls[0]
    name = call.args[0].id
    reads = sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(statement.value))
    if reads != 1 or name in stored or name == "self":
        return None
    return name, call.func.attr, call


def _head_norms(body: list[ast.stmt], found: list[tuple[str, ...]]) -> list[ast.stmt]:
    """``body`` with each rope statement whose q and k come straight from a norm call
    rewritten as :func:`rewritten_forward`'s ``head_norms`` kind says; each pair of
    norms appended to ``found``."""
    body = list(body)
    for r, statement in enumerate(body):
        rope = _rope_call(statement)
        if rope is None:
            continue
        names, call = rope
        places = [_normed_at(body, r, name) for name in names]
        if None in places or places[0][0] == places[1][0]:
            continue
        for at, norm_call, _, _ in places:
            body[at] = _ReplaceNode(norm_call, None, norm_call.args[0]).visit(body[at])
        transposed = ast.Tuple([ast.Constant(p[3]) for p in places], ast.Load())
        helper = ast.Call(
            ast.Name(HEAD_NORMS_FUNCTION, ast.Load()),
            [ast.Name(ROPE_NAME, ast.Load()), *call.args[:2],
             *(ast.Attribute(ast.Name("self", ast.Load()), p[2], ast.Load()) for p in places),
             transposed, *call.args[2:]],
            call.keywords,
        )  # fmt: skip
        body[r] = ast.fix_missing_locations(
            ast.copy_location(ast.Assign(statement.targets, helper), statement)
        )
        found.append((places[0][2], places[1][2]))
    return body


def _rope_call(statement: ast.stmt) -> tuple[tuple[str, str], ast.Call] | None:
    """``((q, k), call)`` for ``q, k = apply_rotary_pos_emb(q, k, ...)``; else None."""
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Tuple)
        and isinstance(statement.value, ast.Call)
        and getattr(statement.value.func, "id", None) == ROPE_NAME
    ):
        return None
    targets, call = statement.targets[0].elts, statement.value
    names = tuple(getattr(t, "id", None) for t in targets)
    if (
        len(names) != 2
        or None in names
        or names[0] == names[1]
        or len(call.args) < 2
        or any(isinstance(a, ast.Starred) for a in call.args)
        or tuple(getattr(a, "id", None) for a in call.args[:2]) != names
    ):
        return None
    return names, call


def _normed_at(body: list[ast.stmt], before: int, name: str) -> tuple | None:
    """``(index, norm call, norm, transposed)`` of the last statement before ``before``
    that assigns ``name`` from ``self.<norm>(x)`` or ``self.<norm>(x).transpose(1, 2)``
    (``transposed``), where no statement between reads or assigns ``name``; else None."""
    for at in range(before - 1, -1, -1):
        statement = body[at]
        if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(statement)):
            break
    else:
        return None
    if not _assigns_one_name(statement) or statement.targets[0].id != name:
        return None
    value = statement.value
    transposed = (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "transpose"
        and not value.keywords
        and [getattr(a, "value", None) for a in value.args] == [1, 2]
    )
    if transposed:
        value = value.func.value
    if not (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and getattr(value.func.value, "id", None) == "self"
        and len(value.args) == 1
        and not value.keywords
        and not isinstance(value.args[0], ast.Starred)
    ):
        return None
    return at, value, value.func.attr, transposed


class _ReplaceNode(ast.NodeTransformer):
    """Replaces one node (by identity) with a load of ``name``, or with ``by``."""

    def __init__(self, node: ast.AST, name: str | None, by: ast.expr | None = None) -> None:
        self.node, self.name, self.by = node, name, by

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.node:
            new = self.by if self.by is not None else ast.Name(self.name, ast.Load())
            return ast.copy_location(new, node)
        return super().visit(node)


# Each kind of rewrite: ``(body, found) -> body``; applied in this order (a residual
# triple's last two statements would otherwise read as a linear_act pair).
_REWRITES: dict[str, Callable[[list[ast.stmt], list[tuple[str, ...]]], list[ast.stmt]]] = {
    "residual": _residuals,
    "linear_act": functools.partial(_rewritten_body, width=2, match=_pair_match),
    "projections": _joined_calls,
    "head_norms": _head_norms,
}

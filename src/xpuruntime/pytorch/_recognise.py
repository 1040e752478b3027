"""Recognising the building blocks of models we did not write by what they compute.

Model libraries define their own norm classes (transformers 5.x has one RMSNorm class per
architecture, most identical in code to Llama's, some not: Gemma scales by
``1 + weight``, Qwen3.5's takes a gate). A class name says nothing reliable about the
computation, so a candidate (a module holding only a 1-D ``weight`` and a float epsilon)
is run once on probe inputs and compared with the formula in float64: a module that
computes ``weight * x / sqrt(mean(x²) + eps)`` over the last dimension is an RMSNorm,
whatever its name; anything else is reported with what it computes instead. Likewise a
module with three linear layers (two into an inner width, one back) that computes
``down(silu(gate(x)) * up(x))`` is a SwiGLU MLP (with GELU's tanh form, a GeGLU MLP),
whichever child is the gate. An
attention module whose forward calls its modeling file's ``apply_rotary_pos_emb`` (a
module-level function Llama's attention and ~120 copies share) is a rotary attention if
that function computes the half-split rotation on probe inputs; its forward can then run
with the ``rope`` op in that function's place, bound on the instance alone. A decoder
layer whose forward adds a branch to its residual and normalises the sum in three
statements (``h = residual + h; residual = h; h = self.norm(h)``, Llama's and ~250 other
modeling files') gets a copy of its forward with those three statements as one call of
the residual-norm op, which computes the same; the rest of the forward is unchanged.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "gated_mlp_match",
    "gelu_form",
    "linear_act_forward",
    "linear_kind",
    "residual_norm_forward",
    "rms_norm_match",
    "rope_attention_match",
]

ROPE_FUNCTION = "apply_rotary_pos_emb"
RESIDUAL_FUNCTION = "_xpuruntime_residual_norm"
"""The name the rewritten decoder forwards call the residual add and norm by."""
LINEAR_ACT_FUNCTION = "_xpuruntime_linear_act"
"""The name rewritten forwards call a linear layer and its activation by."""

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def rms_norm_match(module: nn.Module) -> tuple[float | None, str, float] | None:
    """Whether ``module`` computes an RMSNorm: None when it is no candidate (not a leaf
    holding exactly a 1-D ``weight`` and a float epsilon); else ``(eps, why, offset)``:
    the norm scales by ``offset + weight`` (0: Llama's form, 1: Gemma's ``1 + weight``),
    with ``eps`` None and ``why`` saying what it computes when the probe refutes both."""
    eps = _candidate_eps(module)
    if eps is None:
        return None
    weight = module.weight
    unprobed = _unprobed(weight)
    if unprobed is not None:
        return None, unprobed, 0.0
    size = weight.shape[0]
    generator = torch.Generator().manual_seed(size)
    # Unit-scale rows test the formula; rows whose mean square is a few eps test eps.
    normal = torch.randn(3, size, generator=generator, dtype=torch.float64)
    small = normal * (4 * max(eps, 1e-12)) ** 0.5
    probe = torch.cat([normal, small]).to(torch.float32)
    # Probe weights of its own, not the module's (ones or zeros at initialisation would
    # let a forward that ignores its weight pass); the module's are put back after.
    kept = weight.detach().clone()
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            weight.copy_(torch.randn(size, generator=generator).to(weight.dtype))
            w = weight.detach().to("cpu", torch.float64)
            got = type(module).forward(module, probe.to(weight.device))
    except Exception as e:  # another signature (a gate), or another input contract
        why = f"its forward does not take the hidden states alone ({type(e).__name__})"
        return None, why, 0.0
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None, "its forward returns something other than the normalised input", 0.0
    got = got.detach().to("cpu", torch.float64)
    x = probe.to(torch.float64)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if _close(got, w * normed):
        return eps, f"computes weight * x / rms(x) with eps={eps:g} (checked on a probe)", 0.0
    if _close(got, (1 + w) * normed):
        why = f"computes (1 + weight) * x / rms(x) (Gemma's form) with eps={eps:g} (checked on a probe)"
        return eps, why, 1.0
    return None, "does not compute weight * x / rms(x) over the last dimension", 0.0


def _candidate_eps(module: nn.Module) -> float | None:
    """The epsilon of a module shaped as an RMSNorm (a leaf, a 1-D ``weight`` its only
    parameter, no buffers, a float epsilon attribute), or None."""
    if next(module.children(), None) is not None or next(module.buffers(False), None) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if len(params) != 1 or weight is None or weight.dim() != 1 or not weight.is_floating_point():
        return None
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float) and value >= 0:
            return value
    return None


def _unprobed(weight: torch.Tensor) -> str | None:
    """Why a module holding ``weight`` cannot be run on a probe here (None: it can)."""
    if weight.device.type == "meta":
        return "its weights are on the meta device, so what it computes was not checked"
    if type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor":
        return "its weights are sharded (DTensor), so what it computes was not checked"
    return None


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-2) -> bool:
    """Within ``tolerance`` of each row's largest value (what fp32 arithmetic and a
    half-precision weight leave, by default)."""
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return bool(((got - want).abs() / scale).max() <= tolerance)


def gated_mlp_match(
    module: nn.Module,
) -> tuple[tuple[str, str, str] | None, str, str] | None:
    """Whether ``module`` computes a gated MLP, ``down(act(gate(x)) * up(x))`` with SiLU
    (SwiGLU) or GELU's tanh form (GeGLU): None when it is no candidate (not three
    ``nn.Linear`` children, two from the width H into I and one back, or two, one from H
    into 2I whose halves are gate and up (Phi-3's and GLM4's ``gate_up_proj``) and one
    back, plus at most parameter-free ones); else ``(names, why, kind)``, with the (gate,
    up, down) child names (up ``""`` for the packed form) and ``kind`` ``'swiglu'`` or
    ``'geglu'``, or None and what it computes instead."""
    if "forward" in module.__dict__:
        return None  # bound on the instance already (by us, or by someone else)
    linears = {n: c for n, c in module.named_children() if type(c) is nn.Linear}
    others = [c for n, c in module.named_children() if n not in linears]
    if len(linears) not in (2, 3) or any(next(c.parameters(), None) is not None for c in others):
        return None
    if next(module.parameters(recurse=False), None) is not None:
        return None
    if len(linears) == 2:
        return _packed_mlp_match(module, linears)
    down = [n for n, c in linears.items() if c.out_features < c.in_features]
    into = [n for n in linears if n not in down]
    if len(down) != 1 or len(into) != 2:
        return None
    first, second = (linears[n] for n in into)
    last = linears[down[0]]
    width, inner = first.in_features, first.out_features
    if (second.in_features, second.out_features, last.in_features, last.out_features) != (
        width, inner, inner, width,
    ):  # fmt: skip
        return None
    a, b = into
    matched, why = _gated_probe(
        module, last, lambda x: {(a, b): (first(x), second(x)), (b, a): (second(x), first(x))}
    )
    if matched is None:
        return None, why or "computes neither down(silu(gate(x)) * up(x)) nor its GELU form", ""
    kind, (gate, up) = matched
    why = f"computes down({_GATES[kind][1]}(gate(x)) * up(x)) (checked on a probe)"
    return (gate, up, down[0]), why, kind


_GATES = {
    "swiglu": (F.silu, "silu"),
    "geglu": (lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh"),
}


def _gated_probe(
    module: nn.Module, last: nn.Linear, split: Callable[[torch.Tensor], dict[Any, tuple]]
) -> tuple[tuple[str, Any] | None, str]:
    """Run ``module``'s own forward on a probe and compare it with ``last(act(g) * u)``
    for each activation of :data:`_GATES` and each ``label -> (g, u)`` that
    ``split(x)`` gives (in float64): ``((kind, label), "")`` for the first that
    matches; ``(None, why)`` when none does (``why`` empty: it ran, and matched none)."""
    weight = last.weight
    unprobed = _unprobed(weight)
    if unprobed is not None:
        return None, unprobed
    width = last.out_features
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(2, 3, width, generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            got = type(module).forward(module, x).double()
            pairs = split(x)
            outputs = {
                (kind, label): F.linear(
                    act(g.double()) * u.double(), weight.double(), _double(last.bias)
                )
                for kind, (act, _) in _GATES.items()
                for label, (g, u) in pairs.items()
            }
    except Exception as e:  # another signature, or another input contract
        return None, f"its forward does not take the hidden states alone ({type(e).__name__})"
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None, "its forward returns something other than the MLP's output"
    # Half-precision weights compute in half precision: further from the float64 form,
    # still far nearer than the other assignment of gate and up, or one activation for
    # the other.
    tolerance = 1e-4 if weight.dtype == torch.float32 else 5e-2
    for key, want in outputs.items():
        if _close(got, want, tolerance):
            return key, ""
    return None, ""


def _packed_mlp_match(
    module: nn.Module, linears: dict[str, nn.Linear]
) -> tuple[tuple[str, str, str] | None, str, str] | None:
    """:func:`gated_mlp_match` for ``down(act(g) * u)`` with ``g, u = gate_up(x).chunk(2)``."""
    (packed, inner), (down, last) = sorted(linears.items(), key=lambda item: -item[1].out_features)
    if (inner.in_features, inner.out_features, last.out_features) != (
        last.out_features, 2 * last.in_features, inner.in_features,
    ):  # fmt: skip
        return None

    def halves(x: torch.Tensor) -> dict[bool, tuple]:
        g, u = inner(x).chunk(2, dim=-1)
        return {True: (g, u), False: (u, g)}  # the gate first, or second

    matched, why = _gated_probe(module, last, halves)
    if matched is None:
        why = why or f"does not compute down(act(g) * u) with g, u = {packed}(x).chunk(2)"
        return None, why, ""
    kind, gate_first = matched
    form = f"down({_GATES[kind][1]}(g) * u) with g, u = {packed}(x).chunk(2)"
    if not gate_first:
        return None, f"computes {form} with the gate second (not bound)", ""
    return (packed, "", down), f"computes {form} (checked on a probe)", kind


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def rope_attention_match(
    module: nn.Module, replacement: Callable[[Callable[..., Any], bool], Callable[..., Any]]
) -> tuple[Callable[..., Any] | None, str] | None:
    """Whether ``module``'s forward applies a rotary embedding we can run: None when it
    is no candidate (its class's forward, through its decorators, never calls a global
    ``apply_rotary_pos_emb``); else ``(forward, why)``: a copy of that forward whose
    ``apply_rotary_pos_emb`` is ``replacement(original, interleaved)`` (None, and what
    the original computes instead, when the probe refutes both layouts)."""
    chain = _class_forward(module, _calls_rope)
    if chain is None:
        return None
    inner = chain[-1]
    original = inner.__globals__[ROPE_FUNCTION]
    interleaved, why = _rope_probe(original)
    if interleaved is None:
        return None, why
    rope = replacement(original, interleaved)
    namespace = _namespace(inner.__globals__, {ROPE_FUNCTION: rope})
    return _rebuilt(chain, _copy(inner, namespace, inner.__closure__)), why


def _calls_rope(function: types.FunctionType) -> bool:
    """Whether ``function`` calls ``apply_rotary_pos_emb`` from its module's globals."""
    return ROPE_FUNCTION in function.__code__.co_names and callable(
        function.__globals__.get(ROPE_FUNCTION)
    )


def _class_forward(
    module: nn.Module, found: Callable[[types.FunctionType], bool]
) -> list[types.FunctionType] | None:
    """:func:`_decorated` of ``module``'s class's forward; None where a forward is bound
    on the instance already (ours, or the user's)."""
    if "forward" in module.__dict__:
        return None
    return _decorated(getattr(type(module), "forward", None), found)


def _decorated(
    function: Any, found: Callable[[types.FunctionType], bool]
) -> list[types.FunctionType] | None:
    """The functions from ``function`` down through its decorators (each holding the
    next in a closure cell) to the one ``found`` accepts; None where there is none."""
    chain: list[types.FunctionType] = []
    while isinstance(function, types.FunctionType) and len(chain) < 8:
        chain.append(function)
        if found(function):
            return chain
        inner = getattr(function, "__wrapped__", None)
        cells = [c.cell_contents for c in function.__closure__ or () if _filled(c)]
        if inner is None or not any(c is inner for c in cells):
            return None  # not a decorator holding it in a cell: nothing to rebuild
        function = inner
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _rebuilt(chain: list[types.FunctionType], function: types.FunctionType) -> types.FunctionType:
    """A copy of ``chain[0]`` calling ``function`` where the original called ``chain[-1]``
    (each decorator layer rebuilt around the new inner one)."""
    for outer, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        closure = tuple(
            types.CellType(function) if _filled(c) and c.cell_contents is old else c
            for c in outer.__closure__ or ()
        )
        wrapped, function = function, _copy(outer, outer.__globals__, closure)
        function.__wrapped__ = wrapped  # the copy it calls, for inspect
    return function


_NAMESPACES: dict[tuple, dict[str, Any]] = {}


def _namespace(module_globals: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    """The globals of a modeling file with ``names`` set in them (our
    ``apply_rotary_pos_emb``, our residual helper): a module of its own in
    ``sys.modules`` (one per modeling file and set of names), so that torch.compile,
    which finds a function's globals by its module's name, guards on this namespace and
    not on the modeling file's."""
    key = (module_globals.get("__name__", "?"), *sorted((k, id(v)) for k, v in names.items()))
    namespace = _NAMESPACES.get(key)
    if namespace is None:
        name = f"xpuruntime.pytorch._bound.{key[0]}.{len(_NAMESPACES)}"
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in module_globals.items() if k != "__name__"})
        module.__dict__.update(names)
        sys.modules[name] = module
        namespace = _NAMESPACES[key] = module.__dict__
    return namespace


def _copy(function: types.FunctionType, globals_: dict, closure: Any) -> types.FunctionType:
    copied = types.FunctionType(
        function.__code__, globals_, function.__name__, function.__defaults__, closure
    )
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__dict__.update(function.__dict__)
    copied.__qualname__ = function.__qualname__
    return copied


_ROPE_PROBES: dict[Any, tuple[bool | None, str]] = {}


def _rope_probe(function: Callable[..., Any]) -> tuple[bool | None, str]:
    """``(interleaved, why)``: whether ``function(q, k, cos, sin)`` computes the
    half-split (False) or the interleaved (True) rotation on probe inputs, or None and
    what it does instead; one probe per function object."""
    if function in _ROPE_PROBES:
        return _ROPE_PROBES[function]
    from .ops.rope import torch_rope

    generator = torch.Generator().manual_seed(8)
    # fp32 probes (some forms compute in fp32 whatever they are given: Cohere's), judged
    # against the float64 formula.
    q = torch.randn(2, 3, 5, 8, generator=generator)
    k = torch.randn(2, 1, 5, 8, generator=generator)
    cos = torch.randn(2, 5, 8, generator=generator)
    sin = torch.randn(2, 5, 8, generator=generator)
    found: tuple[bool | None, str]
    try:
        with torch.no_grad():
            got = function(q, k, cos, sin)
    except Exception as e:  # another signature (partial rotary, position ids)
        found = (
            None,
            f"its {ROPE_FUNCTION} does not take (q, k, cos, sin) alone ({type(e).__name__})",
        )
    else:
        found = (
            None,
            f"its {ROPE_FUNCTION} computes neither the half-split nor the interleaved rotation",
        )
        for interleaved, layout in ((False, "half-split"), (True, "interleaved")):
            want = torch_rope(q.double(), k.double(), cos.double(), sin.double(), interleaved)
            if _same_pair(got, want):
                found = (
                    interleaved,
                    f"its {ROPE_FUNCTION} computes the {layout} rotation (checked on a probe)",
                )
                break
    _ROPE_PROBES[function] = found
    return found


def _same_pair(got: Any, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and all(isinstance(g, torch.Tensor) and g.shape == w.shape for g, w in zip(got, want))
        and all(_close(g.double(), w, 1e-5) for g, w in zip(got, want))
    )


# -- residual add + norm in decoder layers -------------------------------------------------------
def residual_norm_forward(
    module: nn.Module, helper: Callable[..., Any]
) -> tuple[types.FunctionType, list[tuple[str, ...]]] | None:
    """A copy of ``module``'s forward (its class's, through its decorators) in which each
    ``h = a + b; kept = h; h = self.<norm>(h)`` (Llama's ``h = residual + h; residual =
    h``; ``a`` and ``b`` any expressions) is ``kept, h = helper(a, b, self.<norm>)``, and
    each such norm's attribute name (1-tuples); None where the forward has no such
    statements (or its source cannot be read). The helper must return ``(a + b, norm(a +
    b))``; whether the attribute is a norm the caller judges."""
    return _rewritten_forward(module, "residual", RESIDUAL_FUNCTION, helper)


def linear_act_forward(
    module: nn.Module, helper: Callable[..., Any]
) -> tuple[types.FunctionType, list[tuple[str, ...]]] | None:
    """A copy of ``module``'s forward in which each ``h = self.<layer>(h); h =
    self.<act>(h)`` is ``h = helper(h, self.<layer>, self.<act>)``, and each such pair's
    attribute names; None where the forward has none. The helper must return
    ``act(layer(h))``; which pairs are worth it (a linear layer and a GELU) the caller
    judges from the names."""
    return _rewritten_forward(module, "linear_act", LINEAR_ACT_FUNCTION, helper)


def _rewritten_forward(
    module: nn.Module, kind: str, name: str, helper: Callable[..., Any]
) -> tuple[types.FunctionType, list[tuple[str, ...]]] | None:
    chain = _class_forward(module, _rewritable)
    if chain is None:
        return None
    inner = chain[-1]
    # Keyed by file too: code objects compare equal across files holding the same source.
    rewritten = _rewritten_code(inner.__code__.co_filename, inner.__code__, kind)
    if rewritten is None:
        return None
    code, found = rewritten
    if not all(isinstance(getattr(module, n, None), nn.Module) for names in found for n in names):
        return None
    namespace = _namespace(inner.__globals__, {name: helper})
    function = _copy(inner, namespace, inner.__closure__)
    function.__code__ = code
    return _rebuilt(chain, function), found


def _rewritable(function: types.FunctionType) -> bool:
    """A forward that may hold statements to rewrite: one taking ``self``, without free
    variables (its code compiles again on its own)."""
    code = function.__code__
    return code.co_argcount > 0 and code.co_varnames[0] == "self" and not code.co_freevars


@functools.cache
def _rewritten_code(
    filename: str, code: types.CodeType, kind: str
) -> tuple[types.CodeType, list[tuple[str, ...]]] | None:
    """The code of the function ``code`` (from ``filename``) belongs to, with its
    statements of ``kind`` rewritten (``"residual"``: :func:`residual_norm_forward`'s,
    ``"linear_act"``: :func:`linear_act_forward`'s), and the attribute names each
    involves; None where it has none, or its source cannot be read and compiled again."""
    try:
        lines, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.name != code.co_name:
        return None
    # The definition alone, as the original's code: no decorators (the chain above is
    # rebuilt around it), no annotations to evaluate, the file's line numbers.
    definition.decorator_list = []
    definition.returns = None
    arguments = definition.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                     arguments.vararg, arguments.kwarg):  # fmt: skip
        if argument is not None:
            argument.annotation = None
    ast.increment_lineno(tree, first - 1)
    # The source read must be the code that runs (a file changed on disk since it was
    # imported is not): compiled as it stands, it gives the same bytecode.
    as_read = _function_code(tree, code)
    if as_read is None or as_read.co_code != code.co_code:
        return None
    found: list[tuple[str, ...]] = []
    definition.body = _rewritten_body(definition.body, found, *_REWRITES[kind])
    if not found:
        return None
    rewritten = _function_code(tree, code)
    if rewritten is None or rewritten.co_freevars != code.co_freevars:
        return None
    return rewritten, found


def _function_code(tree: ast.Module, code: types.CodeType) -> types.CodeType | None:
    """The code of the function named as ``code`` that ``tree`` defines, compiled."""
    try:
        compiled = compile(tree, code.co_filename, "exec")
    except (SyntaxError, ValueError):
        return None
    return next(
        (
            c
            for c in compiled.co_consts
            if isinstance(c, types.CodeType) and c.co_name == code.co_name
        ),
        None,
    )


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


# Each kind of rewrite: how many statements it replaces, and what recognises them.
_REWRITES: dict[str, tuple[int, Callable[[list[ast.stmt]], tuple | None]]] = {
    "residual": (3, _residual_match),
    "linear_act": (2, _pair_match),
}


# -- what a linear layer and an activation module compute ---------------------------------------
def gelu_form(module: nn.Module) -> str | None:
    """``"tanh"`` or ``"none"`` when ``module`` (a leaf without parameters) computes GELU's
    tanh approximation or its exact (erf) form, as ``F.gelu(x, approximate=...)``, on
    probe inputs (transformers' ``NewGELUActivation``, ``GELUTanh``, ``GELUActivation``,
    ``nn.GELU``, ...); else None."""
    if next(module.children(), None) is not None or next(module.parameters(), None) is not None:
        return None
    probe = torch.linspace(-8, 8, 257)
    try:
        with torch.no_grad():
            got = type(module).forward(module, probe)
    except Exception:  # another signature
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    for form in ("tanh", "none"):
        want = F.gelu(probe.double(), approximate=form)
        # the forms differ by up to 5e-4; their implementations by a few fp32 roundings
        if (got.double() - want).abs().max() <= 1e-5:
            return form
    return None


def linear_kind(module: nn.Module) -> str | None:
    """``"linear"`` for an ``nn.Linear`` computing ``x @ weight.T + bias``;
    ``"transposed"`` for a leaf holding a 2-D ``weight`` (in, out) and a ``bias`` (out,)
    that computes ``x @ weight + bias`` on a probe (transformers' ``Conv1D``, GPT-2's);
    else None."""
    if isinstance(module, nn.Linear):
        own = type(module).forward
        return (
            "linear"
            if own is nn.Linear.forward or module.__module__.startswith("xpuruntime")
            else None
        )
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (
        next(module.children(), None) is not None
        or set(params) != {"weight", "bias"}
        or weight.dim() != 2
        or bias.dim() != 1
        or bias.shape[0] != weight.shape[1]
        or _unprobed(weight) is not None
    ):
        return None
    generator = torch.Generator().manual_seed(weight.shape[0])
    probe = torch.randn(3, weight.shape[0], generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            got = type(module).forward(module, probe)
            want = torch.addmm(bias, probe, weight)
    except Exception:
        return None
    if (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and _close(got.double(), want.double(), 1e-3)
    ):
        return "transposed"
    return None

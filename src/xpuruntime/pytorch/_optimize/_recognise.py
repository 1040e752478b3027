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
the residual-norm op, which computes the same; the rest of the forward is unchanged. A
forward whose consecutive statements each call a child on the same input (Llama's
``self.q_proj(h)``, ``self.k_proj(h)``, ``self.v_proj(h)``) gets a copy that makes those
calls once, together, before the first of them (where they can run as one GEMM), and
uses each result where its call stood.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dis
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._functional._linear_view import linear_view

__all__ = [
    "bound_on_instance",
    "called_function",
    "gated_mlp_match",
    "gelu_form",
    "linear_kind",
    "rewritten_forward",
    "rms_norm_match",
    "rope_attention_match",
]

ROPE_FUNCTION = "apply_rotary_pos_emb"
RESIDUAL_FUNCTION = "_xpuruntime_residual_norm"
"""The name the rewritten decoder forwards call the residual add and norm by."""
LINEAR_ACT_FUNCTION = "_xpuruntime_linear_act"
"""The name rewritten forwards call a linear layer and its activation by."""
PROJECTIONS_FUNCTION = "_xpuruntime_projections"
"""The name rewritten forwards call the children that take one input together by."""

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


@contextlib.contextmanager
def weights_left_as_they_are(model: nn.Module) -> Iterator[None]:
    """The probes below run modules in eval mode without gradients, where bitsandbytes'
    4-bit layers on an AVX512-BF16 CPU repack their weights for its CPU kernels (for
    good, and its training path then computes otherwise): its switch for that is off
    while ``model`` is probed."""
    switched = [
        (m, m.support_avx512bf16_for_cpu)
        for m in model.modules()
        if getattr(m, "support_avx512bf16_for_cpu", False)
    ]
    for module, _ in switched:
        module.support_avx512bf16_for_cpu = False
    try:
        yield
    finally:
        for module, value in switched:
            module.support_avx512bf16_for_cpu = value


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
            w = weight.detach().to("cpu", torch.float64, copy=True)  # kept past the restore
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
    if bound_on_instance(module):
        return None  # bound on the instance already (by us, or by someone else)
    # Linear layers as they are, or wrapped (a LoRA adapter's): the layers are called,
    # their shapes read from the plain layer inside.
    views = {n: v for n, c in module.named_children() if (v := linear_view(c)) is not None}
    linears = {n: getattr(module, n) for n in views}
    others = [c for n, c in module.named_children() if n not in linears]
    if len(linears) not in (2, 3) or any(next(c.parameters(), None) is not None for c in others):
        return None
    if next(module.parameters(recurse=False), None) is not None:
        return None
    if len(linears) == 2:
        return _packed_mlp_match(module, linears, views)
    down = [n for n, v in views.items() if v.out_features < v.in_features]
    into = [n for n in linears if n not in down]
    if len(down) != 1 or len(into) != 2:
        return None
    first, second = (linears[n] for n in into)
    f, s, last = views[into[0]], views[into[1]], views[down[0]]
    width, inner = f.in_features, f.out_features
    if (s.in_features, s.out_features, last.in_features, last.out_features) != (
        width, inner, inner, width,
    ):  # fmt: skip
        return None
    a, b = into
    matched, why = _gated_probe(
        module,
        linears[down[0]],
        lambda x: {(a, b): (first(x), second(x)), (b, a): (second(x), first(x))},
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
    module: nn.Module, last: nn.Module, split: Callable[[torch.Tensor], dict[Any, tuple]]
) -> tuple[tuple[str, Any] | None, str]:
    """Run ``module``'s own forward on a probe and compare it with ``last(act(g) * u)``
    for each activation of :data:`_GATES` and each ``label -> (g, u)`` that
    ``split(x)`` gives (in float64 where ``last`` is a plain linear layer; a wrapped one
    is called as it is): ``((kind, label), "")`` for the first that matches; ``(None,
    why)`` when none does (``why`` empty: it ran, and matched none)."""
    view = linear_view(last)
    weight, dtype = view.base.weight, view.weight_dtype
    unprobed = _unprobed(weight)
    if unprobed is not None:
        return None, unprobed

    def down(h: torch.Tensor) -> torch.Tensor:
        if view.plain:
            return F.linear(h, weight.double(), _double(last.bias))
        return last(h.to(dtype)).double()

    width = view.out_features
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(2, 3, width, generator=generator).to(weight.device, dtype)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()  # a LoRA adapter's dropout draws differently on every call
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            got = type(module).forward(module, x).double()
            pairs = split(x)
            outputs = {
                (kind, label): down(act(g.double()) * u.double())
                for kind, (act, _) in _GATES.items()
                for label, (g, u) in pairs.items()
            }
    except Exception as e:  # another signature, or another input contract
        return None, f"its forward does not take the hidden states alone ({type(e).__name__})"
    finally:
        for m, training in modes:
            m.training = training
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None, "its forward returns something other than the MLP's output"
    # Half-precision weights compute in half precision: further from the float64 form,
    # still far nearer than the other assignment of gate and up, or one activation for
    # the other.
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for key, want in outputs.items():
        if _close(got, want, tolerance):
            return key, ""
    return None, ""


def _packed_mlp_match(
    module: nn.Module, linears: dict[str, nn.Module], views: dict[str, Any]
) -> tuple[tuple[str, str, str] | None, str, str] | None:
    """:func:`gated_mlp_match` for ``down(act(g) * u)`` with ``g, u = gate_up(x).chunk(2)``."""
    packed, down = sorted(views, key=lambda n: -views[n].out_features)
    inner, last = linears[packed], linears[down]
    i, o = views[packed], views[down]
    if (i.in_features, i.out_features, o.out_features) != (
        o.out_features, 2 * o.in_features, i.in_features,
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
    ``apply_rotary_pos_emb``); else ``(rope, why)``: ``replacement(original,
    interleaved)``, what its forward is to call by that name
    (:func:`rewritten_forward`'s ``names``), or None, and what the original computes
    instead, when the probe refutes both layouts."""
    chain = _class_forward(module, _calls_rope)
    if chain is None:
        return None
    original = chain[-1].__globals__[ROPE_FUNCTION]
    interleaved, why = _rope_probe(original)
    if interleaved is None:
        return None, why
    return replacement(original, interleaved), why


def _calls_rope(function: types.FunctionType) -> bool:
    """Whether ``function`` calls ``apply_rotary_pos_emb`` from its module's globals."""
    return ROPE_FUNCTION in function.__code__.co_names and callable(
        function.__globals__.get(ROPE_FUNCTION)
    )


def called_function(module: nn.Module, name: str) -> Any:
    """What ``module``'s class forward (through its decorators) calls as the global
    ``name``; None where it calls no such name, or a forward is bound on the instance."""
    chain = _class_forward(module, lambda f: name in f.__code__.co_names)
    return None if chain is None else chain[-1].__globals__.get(name)


def calling_source(module: nn.Module, name: str) -> str | None:
    """The source of the function in ``module``'s class forward (through its decorators)
    that calls the global ``name``; None where there is none or it cannot be read."""
    chain = _class_forward(module, lambda f: name in f.__code__.co_names)
    if chain is None:
        return None
    try:
        return inspect.getsource(chain[-1])
    except (OSError, TypeError):
        return None


def bound_on_instance(module: nn.Module) -> bool:
    """Whether a forward other than its class's own is bound on ``module`` itself (ours,
    or someone else's). An optimized model saved whole (``torch.save``) loads with its
    class's own forward bound there, as pickle rebuilds bound methods by name."""
    bound = module.__dict__.get("forward")
    if bound is None:
        return False
    return getattr(bound, "__func__", None) is not getattr(type(module), "forward", None)


def _class_forward(
    module: nn.Module, found: Callable[[types.FunctionType], bool]
) -> list[types.FunctionType] | None:
    """:func:`_decorated` of ``module``'s class's forward; None where a forward is bound
    on the instance already (ours, or the user's)."""
    if bound_on_instance(module):
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
    from ..ops.rope import torch_rope

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


# -- forwards rewritten ---------------------------------------------------------------------
_HELPERS = {
    "residual": RESIDUAL_FUNCTION,
    "linear_act": LINEAR_ACT_FUNCTION,
    "projections": PROJECTIONS_FUNCTION,
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

    Whether the attributes are what a helper can fuse (a norm, a linear layer and a GELU,
    linear layers of one input) the caller judges; the helpers run any other module as
    written."""
    names = dict(names or {})
    kinds = tuple(kind for kind in _REWRITES if kind in helpers)  # in _REWRITES' order
    chain = _class_forward(module, _rewritable) if kinds else None
    rewritten = None if chain is None else _rewrite_of(module, chain[-1], kinds)
    if rewritten is not None:
        code, found = rewritten
    elif names:
        chain = _class_forward(module, lambda f: any(n in f.__code__.co_names for n in names))
        if chain is None:
            return None
        code, found = chain[-1].__code__, {}
    else:
        return None
    inner = chain[-1]
    names.update({_HELPERS[kind]: helpers[kind] for kind in found})
    function = _copy(inner, _namespace(inner.__globals__, names), inner.__closure__)
    function.__code__ = code
    return _rebuilt(chain, function), found


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


def parsed_source(code: types.CodeType) -> tuple[ast.Module, ast.FunctionDef] | None:
    """The module of one definition holding the source of the function ``code``
    belongs to, and that definition, to rewrite and compile again: no decorators, no
    annotations, the file's line numbers. None where the source cannot be read, or read
    is not the code that runs (a file changed on disk since it was imported)."""
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
    # Compiled as it stands, the source read gives the same instructions as the code.
    as_read = function_code(tree, code)
    if as_read is None or _instructions(as_read) != _instructions(code):
        return None
    return tree, definition


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _instructions(code: types.CodeType) -> list[tuple[str, Any]]:
    """What ``code`` does, as compared with the same source compiled again on its own:
    each instruction and its argument, except what depends on the module it was compiled
    in (a method call on an imported name compiles as an attribute load and a call, not
    a method load) and what follows from that (jump offsets); nested code likewise."""
    out = []
    for i in dis.get_instructions(code):
        name = "LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname
        if i.opcode in _JUMPS:
            out.append((name, None))
        elif isinstance(i.argval, types.CodeType):
            out.append((name, tuple(_instructions(i.argval))))
        else:
            out.append((name, i.argval))
    return out


def function_code(
    tree: ast.Module, code: types.CodeType, name: str | None = None
) -> types.CodeType | None:
    """The code of the function named ``name`` (by default as ``code``) that ``tree``
    defines, compiled as from ``code``'s file."""
    try:
        compiled = compile(tree, code.co_filename, "exec")
    except (SyntaxError, ValueError):
        return None
    return next(
        (
            c
            for c in compiled.co_consts
            if isinstance(c, types.CodeType) and c.co_name == (name or code.co_name)
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


class _ReplaceNode(ast.NodeTransformer):
    """Replaces one node (by identity) with a load of ``name``."""

    def __init__(self, node: ast.AST, name: str) -> None:
        self.node, self.name = node, name

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.node:
            return ast.copy_location(ast.Name(self.name, ast.Load()), node)
        return super().visit(node)


# Each kind of rewrite: ``(body, found) -> body``; applied in this order (a residual
# triple's last two statements would otherwise read as a linear_act pair).
_REWRITES: dict[str, Callable[[list[ast.stmt], list[tuple[str, ...]]], list[ast.stmt]]] = {
    "residual": _residuals,
    "linear_act": functools.partial(_rewritten_body, width=2, match=_pair_match),
    "projections": _joined_calls,
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

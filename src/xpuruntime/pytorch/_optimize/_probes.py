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
whichever child is the gate. An attention module whose forward calls its modeling
file's ``apply_rotary_pos_emb`` (a module-level function Llama's attention and ~120
copies share) is a rotary attention if that function computes the half-split rotation
on probe inputs. Activation modules and linear layers (``nn.Linear``, transformers'
``Conv1D``) are told apart the same way.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._linear_view import linear_view
from ._functions import bound_on_instance, class_forward

__all__ = [
    "ROPE_FUNCTION",
    "gated_mlp_match",
    "gelu_form",
    "linear_kind",
    "rms_norm_match",
    "rope_attention_match",
    "weights_left_as_they_are",
]

ROPE_FUNCTION = "apply_rotary_pos_emb"


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
        if view.dense:
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
    chain = class_forward(module, _calls_rope)
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


_ROPE_PROBES: dict[Any, tuple[bool | None, str]] = {}


def _rope_probe(function: Callable[..., Any]) -> tuple[bool | None, str]:
    """``(interleaved, why)``: whether ``function(q, k, cos, sin)`` computes the
    half-split (False) or the interleaved (True) rotation on probe inputs, or None and
    what it does instead; one probe per function object."""
    if function in _ROPE_PROBES:
        return _ROPE_PROBES[function]
    from .._ops.rope import torch_rope

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

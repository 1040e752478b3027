"""A linear layer with a LoRA adapter, routed by the policy: ``lora_linear`` (what the
forwards :func:`optimize` binds on peft's ``lora.Linear`` layers call). Kernels:
``fused`` (:func:`ops.lora_linear.lora_projections`: one autograd node, the low-rank term accumulated
into the base GEMM), ``torch`` (the chain as peft writes it); ``auto``: the first that
runs, or the fastest measured under ``best_performance``. :func:`lora_term` says which
adapter a layer runs now, or why the op does not cover it (DoRA, an adapter bias,
merged or disabled adapters, several active ones, a dropout other than ``nn.Dropout``):
such a call runs as peft writes it. An adapter's dropout: the ``fused`` kernel draws
the masks inside its GEMMs from one seed per call (each element kept with probability
``1 - p``, independently per adapter, as peft's; not PyTorch's draws: see
:mod:`.._ops._infra._lora_dropout`); the ``torch`` kernel draws them as peft does (on the input
cast to the adapter's dtype, one mask per layer, in the layers' order), so a seeded run
draws the masks peft would."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .._kernels._context import LoraContext
from .._linear_view import linear_view
from .._ops._infra._fp8_weight import Fp8Weight
from .._ops._infra._launch import autocast_dtype
from .._ops.lora_linear import quant_state, weight_dtype, weight_rows
from .._selection._routed import RoutedOp

__all__ = [
    "LoraTerm",
    "bitsandbytes_row",
    "joinable_terms",
    "lora_group",
    "lora_linear",
    "lora_projections",
    "lora_term",
]

_grad_enabled = torch.is_grad_enabled


class LoraTerm(NamedTuple):
    """The one adapter a LoRA layer adds now: ``scaling * B(A(dropout(x)))``, with
    ``dropout`` the probability its ``nn.Dropout`` drops with on this call (0: none),
    ``x`` cast to ``cast`` first where peft casts it (None: as it comes). ``a_weight``
    and ``b_weight`` are ``a.weight`` and ``b.weight`` as they are now. (A tuple: one is
    made for every adapted layer's every call.)"""

    a: nn.Linear
    b: nn.Linear
    a_weight: torch.Tensor
    b_weight: torch.Tensor
    scaling: float
    dropout: float = 0.0
    cast: torch.dtype | None = None


def lora_term(layer: nn.Module) -> LoraTerm | str:
    """The adapter term ``layer`` (peft's ``lora.Linear``, or one built like it) adds on
    its next call, or why the ``lora_linear`` op does not cover it."""
    # Read on every call of every adapted layer: submodules and parameters are taken
    # from the module's own tables (nn.Module's attribute fallback costs a Python call).
    if getattr(layer, "disable_adapters", False):
        return "its adapters are disabled"
    if getattr(layer, "merged", False):
        return "its adapters are merged into the base weight"
    modules = layer._modules
    lora_as = modules["lora_A"]._modules
    active = [name for name in getattr(layer, "active_adapters", ()) if name in lora_as]
    if len(active) != 1:
        return f"{len(active)} active adapters (the op runs one)"
    (name,) = active
    variants, dora = getattr(layer, "lora_variant", _EMPTY), getattr(layer, "use_dora", _EMPTY)
    if name in variants or dora.get(name):
        return f"adapter {name!r} is a variant (DoRA or another)"
    a, b = lora_as[name], modules["lora_B"]._modules[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear:
        return f"adapter {name!r} is not two plain linear layers without bias"
    a_parameters = a._parameters
    if a_parameters.get("bias") is not None:
        return f"adapter {name!r} is not two plain linear layers without bias"
    if b._parameters.get("bias") is not None:
        return f"adapter {name!r} has a bias (lora_bias)"
    dropouts = modules.get("lora_dropout")
    dropout = None if dropouts is None else dropouts._modules.get(name)
    p = 0.0
    if dropout is not None and not isinstance(dropout, nn.Identity):
        if type(dropout) is not nn.Dropout or dropout.inplace:
            kind = type(dropout).__name__
            return f"adapter {name!r} has a dropout other than nn.Dropout ({kind})"
        p = float(dropout.p) if dropout.training else 0.0
    a_weight, b_weight = a_parameters["weight"], b._parameters["weight"]
    cast = a_weight.dtype if getattr(layer, "cast_input_dtype_enabled", True) else None
    return LoraTerm(a, b, a_weight, b_weight, float(layer.scaling[name]), p, cast)


_EMPTY: dict = {}
_NO_DROPOUT = (0.0, None)  # (a layer without an adapter draws no mask)


def lora_linear(x: torch.Tensor, base: nn.Linear, term: LoraTerm | None) -> torch.Tensor:
    """``base(x) + term.scaling * term.b(term.a(x))`` by the kernel the policy's
    ``lora_linear`` op picks (``term`` None: ``base(x)``, a 4-bit base without an
    adapter)."""
    return lora_projections(x, ((base, term),))[0]


def lora_projections(
    x: torch.Tensor, layers: tuple[tuple[nn.Module, LoraTerm | None], ...]
) -> tuple[torch.Tensor, ...]:
    """Each ``base(x) + scaling * B(A(x))`` of ``layers`` (LoRA layers of one input; a
    term of None: ``base(x)``, a frozen layer without an adapter), by the kernel the
    policy's ``lora_linear`` op picks: ``fused`` runs them as one node (joined base
    GEMM, joined A, block-diagonal B)."""
    weights, biases, lora_as, lora_bs, scalings, dropped = [], [], [], [], [], False
    for base, term in layers:
        parameters = base._parameters
        weights.append(parameters["weight"])
        biases.append(parameters.get("bias"))
        if term is None:  # (no adapter: no A, B or scale)
            lora_as.append(None)
            lora_bs.append(None)
            scalings.append(0.0)
            continue
        lora_as.append(term.a_weight)
        lora_bs.append(term.b_weight)
        scalings.append(term.scaling)
        dropped = dropped or bool(term.dropout)
    dropout = ()
    if dropped:
        dropout = tuple(_NO_DROPOUT if t is None else (t.dropout, t.cast) for _, t in layers)
    return _routed(
        x, tuple(weights), tuple(biases) if biases[0] is not None else (), tuple(lora_as),
        tuple(lora_bs), tuple(scalings), _compute(x), dropout,
    )  # fmt: skip


def lora_group(layers: tuple[nn.Module, ...], views: tuple | None = None) -> tuple | None:
    """``((base, term), ...)`` where ``layers`` are LoRA layers the op can run together
    now (each one active plain adapter, or a frozen layer without one, its term None:
    what peft's default targets leave beside q and v), else None. Their bases are all
    4-bit or all dense, of one input width and dtype, all with a bias or none, without
    hooks; a group of dense layers alone is the ``projections`` op's. ``views``: their
    :func:`linear_view`, where the caller has them."""
    if len(layers) < 2:
        return None
    if views is None:
        views = tuple(linear_view(layer) for layer in layers)
    found, adapted = [], False
    for layer, view in zip(layers, views):
        if view is None or layer._forward_hooks or layer._forward_pre_hooks:
            return None
        if view.plain:  # without an adapter: its GEMM joins the others'
            if view.dense and view.base.weight.requires_grad:
                return None  # (a trained layer: its gradient is its own op's)
            found.append((view.base, None))
            continue
        term = lora_term(layer)
        if isinstance(term, str):
            return None
        found.append((view.base, term))
        adapted = True
    first = found[0][0]
    width, dtype, bias = first.in_features, weight_dtype(first.weight), first.bias is None
    four_bit = quant_state(first.weight) is not None
    if not adapted and not four_bit:
        return None
    for base, _ in found[1:]:
        if (
            base.in_features != width
            or weight_dtype(base.weight) != dtype
            or (base.bias is None) != bias
            or (quant_state(base.weight) is not None) != four_bit
        ):
            return None
    return tuple(found)


def joinable_terms(
    x: object, layers: tuple[nn.Module, ...], views: tuple | None = None
) -> tuple | None:
    """:func:`lora_group` of ``layers`` where the op computes what peft would for this
    call (:func:`fits`), else None (4-bit layers without an adapter, called on one row
    without gradients, as bitsandbytes writes them: :func:`bitsandbytes_row`)."""
    group = lora_group(layers, views)
    if group is None or not isinstance(x, torch.Tensor):
        return None
    if all(term is None for _, term in group) and bitsandbytes_row(x):
        return None
    device, autocast = x.device, autocast_dtype(x.device.type)
    if not all(_fits(x, device, autocast, base, term) for base, term in group):
        return None
    return group


def bitsandbytes_row(x: torch.Tensor) -> bool:
    """Whether a 4-bit layer without an adapter is left to bitsandbytes: one row without
    gradients (a generated token), which its ``gemv_4bit`` reads the weight once for."""
    return not _grad_enabled() and x.numel() == x.shape[-1]


def fits(x: object, base: nn.Module, term: LoraTerm | None) -> bool:
    """Whether the op computes what peft would for this call: a float tensor on the
    layer's device, and (without autocast) one dtype throughout, as peft's chain then
    adds an adapter of another dtype in that dtype."""
    if not isinstance(x, torch.Tensor):
        return False
    return _fits(x, x.device, autocast_dtype(x.device.type), base, term)


def _fits(
    x: torch.Tensor,
    device: torch.device,
    autocast: torch.dtype | None,
    base: nn.Module,
    term: LoraTerm | None,
) -> bool:
    weight = base._parameters["weight"]
    state = quant_state(weight)
    # (A 4-bit weight's device read from its scales: each property of bitsandbytes'
    # tensor subclass runs its __torch_function__.)
    if device != (weight.device if state is None else state.absmax.device):
        return False
    # A 4-bit base takes any float input (bitsandbytes casts it to its compute dtype and
    # its output back), so it sets no dtype of its own.
    base_dtype = x.dtype if state is not None else weight.dtype
    dtypes = (x.dtype, base_dtype)
    if term is not None:
        dtypes += (term.a_weight.dtype, term.b_weight.dtype)
    if autocast is None:
        return x.dtype.is_floating_point and dtypes.count(x.dtype) == len(dtypes)
    return all(d.is_floating_point for d in dtypes)


def _compute(x: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x.device.type) or x.dtype


# The op's arguments: (x, weights, biases, As, Bs, scalings, compute dtype, dropout), a
# tuple per layer (dropout: each adapter's (p, the dtype peft casts its input to), or
# none); the scalings are runtime arguments (each layer's own), not part of the
# signature; the probabilities are, since they decide which kernel can draw them.
def _signature(x, weights, biases, lora_as, lora_bs, scalings, dtype, dropout) -> tuple:
    if type(weights[0]) is not nn.Parameter:  # bitsandbytes' Params4bit: read past its
        with _plain_tensors():  # __torch_function__ (a Python call per property read)
            return _signature_of(x, weights, biases, lora_as, dtype, dropout)
    return _signature_of(x, weights, biases, lora_as, dtype, dropout)


_plain_tensors = torch._C.DisableTorchFunctionSubclass


def _signature_of(x, weights, biases, lora_as, dtype, dropout) -> tuple:
    shapes = tuple(None if a is None else a.shape for a in lora_as)
    a_dtype = next((a.dtype for a in lora_as if a is not None), None)
    return (x.shape, x.dtype, x.device, tuple(w.shape for w in weights), weights[0].dtype,
            shapes, a_dtype, bool(biases), weights[0].requires_grad, type(weights[0]),
            dtype, _grad_enabled(), dropout)  # fmt: skip


def _context(x, weights, biases, lora_as, lora_bs, scalings, dtype, dropout) -> LoraContext:
    quantized = quant_state(weights[0]) is not None
    four_bit_fp8 = None
    if quantized:  # (the Triton pass that makes a 4-bit group FP8 reads it, or says why)
        from .._ops._infra._launch import triton_unavailable

        four_bit_fp8 = triton_unavailable(x.device)
        if four_bit_fp8 is None:
            from .._ops.nf4 import fp8_4bit_unsupported

            four_bit_fp8 = fp8_4bit_unsupported(weights)
    # (each adapter's: a layer without one has no rank nor dropout)
    ranks = tuple(a.shape[0] for a in lora_as if a is not None)
    ps = tuple(p for (p, _), a in zip(dropout, lora_as) if a is not None)
    return LoraContext(
        x, sum(weight_rows(w) for w in weights), sum(ranks), dtype,
        bool(biases), weights[0].requires_grad, layers=len(weights),
        ranks=ranks, dropout=ps,
        quantized=quantized, four_bit_fp8=four_bit_fp8,
        stored_fp8=type(weights[0]) is Fp8Weight,
    )  # fmt: skip


def _sample(ctx: LoraContext, x, weights, biases, lora_as, lora_bs, scalings, dtype, dropout):
    """Fresh arguments shaped as the call's: an input and adapter weights that train, the
    bases as the call has them."""
    x2 = torch.randn_like(x).requires_grad_(ctx.requires_grad)
    as2 = tuple(None if a is None else (torch.randn_like(a) * a.shape[-1] ** -0.5)
                .requires_grad_(ctx.requires_grad) for a in lora_as)  # fmt: skip
    bs2 = tuple(None if b is None else torch.randn_like(b).requires_grad_(ctx.requires_grad)
                for b in lora_bs)  # fmt: skip
    frozen = (
        tuple(w if quant_state(w) is not None else w.detach() for w in weights),
        tuple(b.detach() for b in biases),
    )
    trained = [t for t in (*as2, *bs2) if t is not None]
    return (x2, *frozen, as2, bs2, scalings, dtype, dropout), [x2, *trained]


_routed = RoutedOp("lora_linear", signature=_signature, context=_context, sample=_sample)

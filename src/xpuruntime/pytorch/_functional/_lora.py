"""A linear layer with a LoRA adapter, routed by the policy: ``lora_linear`` (what the
forwards :func:`optimize` binds on peft's ``lora.Linear`` layers call). Kernels:
``fused`` (:func:`ops.lora_linear`: one autograd node, the low-rank term accumulated
into the base GEMM), ``torch`` (the chain as peft writes it); ``auto``: the first that
runs, or the fastest measured under ``best_performance``. :func:`lora_term` says which
adapter a layer runs now, or why the op does not cover it (dropout, DoRA, an adapter
bias, merged or disabled adapters, several active ones): such a call runs as peft
writes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._kernels._context import LoraContext
from .._selection._routed import RoutedOp
from ..ops._launch import autocast_dtype

__all__ = ["LoraTerm", "lora_linear", "lora_term"]

_grad_enabled = torch.is_grad_enabled


@dataclass(frozen=True)
class LoraTerm:
    """The one adapter a LoRA layer adds now: ``scaling * B(A(x))``."""

    a: nn.Linear
    b: nn.Linear
    scaling: float


def lora_term(layer: nn.Module) -> LoraTerm | str:
    """The adapter term ``layer`` (peft's ``lora.Linear``, or one built like it) adds on
    its next call, or why the ``lora_linear`` op does not cover it."""
    if getattr(layer, "disable_adapters", False):
        return "its adapters are disabled"
    if getattr(layer, "merged", False):
        return "its adapters are merged into the base weight"
    active = [name for name in getattr(layer, "active_adapters", ()) if name in layer.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters (the op runs one)"
    (name,) = active
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name):
        return f"adapter {name!r} is a variant (DoRA or another): run as peft writes it"
    a, b = layer.lora_A[name], layer.lora_B[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None:
        return f"adapter {name!r} is not two plain linear layers without bias"
    if b.bias is not None:
        return f"adapter {name!r} has a bias (lora_bias)"
    dropout = layer.lora_dropout[name] if name in getattr(layer, "lora_dropout", {}) else None
    if dropout is not None and not isinstance(dropout, nn.Identity):
        if not (isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)):
            return f"adapter {name!r} has dropout {getattr(dropout, 'p', '?')} (not fused yet)"
    return LoraTerm(a, b, float(layer.scaling[name]))


def lora_linear(x: torch.Tensor, base: nn.Linear, term: LoraTerm) -> torch.Tensor:
    """``base(x) + term.scaling * term.b(term.a(x))`` by the kernel the policy's
    ``lora_linear`` op picks."""
    weights = (base.weight, base.bias, term.a.weight, term.b.weight)
    return _routed(x, *weights, term.scaling, _compute(x))


def fits(x: object, base: nn.Linear, term: LoraTerm) -> bool:
    """Whether the op computes what peft would for this call: a float tensor on the
    layer's device, and (without autocast) one dtype throughout, as peft's chain then
    adds an adapter of another dtype in that dtype."""
    if not isinstance(x, torch.Tensor) or x.device != base.weight.device:
        return False
    tensors = (x, base.weight, term.a.weight, term.b.weight)
    if autocast_dtype(x.device.type) is None:
        return len({t.dtype for t in tensors}) == 1 and x.dtype.is_floating_point
    return all(t.dtype.is_floating_point for t in tensors)


def _compute(x: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x.device.type) or x.dtype


# The op's arguments: (x, weight, bias, a, b, scaling, compute dtype); the scaling is a
# runtime argument (a layer's own), not part of the signature.
def _signature(x, weight, bias, a, b, scaling, dtype) -> tuple:
    return (x.shape, x.dtype, x.device, weight.shape, weight.dtype, a.shape, a.dtype,
            bias is not None, weight.requires_grad, dtype, _grad_enabled())  # fmt: skip


def _context(x, weight, bias, a, b, scaling, dtype) -> LoraContext:
    return LoraContext(x, weight.shape[0], a.shape[0], dtype, bias is not None,
                       weight.requires_grad)  # fmt: skip


def _sample(ctx: LoraContext, x, weight, bias, a, b, scaling, dtype):
    """Fresh arguments shaped as the call's: an input and adapter weights that train, the
    base as the call has it."""
    x2 = torch.randn_like(x).requires_grad_(ctx.requires_grad)
    a2 = (torch.randn_like(a) * a.shape[-1] ** -0.5).requires_grad_(ctx.requires_grad)
    b2 = torch.randn_like(b).requires_grad_(ctx.requires_grad)
    frozen = (weight.detach(), None if bias is None else bias.detach())
    return (x2, *frozen, a2, b2, scaling, dtype), [x2, a2, b2]


_routed = RoutedOp("lora_linear", signature=_signature, context=_context, sample=_sample)

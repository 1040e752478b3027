"""The policy's ``projections`` op: linear layers that take one input, as one GEMM.

A transformer projects each hidden state several times: Llama's attention into queries,
keys and values (``self.q_proj(h)``, ``self.k_proj(h)``, ``self.v_proj(h)``), its MLP
into gate and up. Run as written under autocast, each layer casts the (fp32) input to
bf16 again, keeps its own bf16 copy for its backward (three copies of each attention
input, two of each MLP input), runs a narrower GEMM, and in the backward the input's
gradients come back as separate bf16 GEMM outputs that are cast and summed in fp32. The
``fused`` kernel concatenates the weights (cast and joined in one copy) and runs one
GEMM each way: one cast and one kept copy of the input, one wider GEMM, and the input's
gradient as one GEMM over the joined width (its sum over the layers accumulated in the
GEMM, in fp32). The results are views of the joined output.

Kernels: ``fused`` (the GEMM over the joined weights), ``torch`` (each layer as
written); ``auto``: the first that runs, under ``best_performance`` too (timed alone, the
separate GEMMs can win while the step loses what joining saves after the op). Under ``torch.compile`` ``auto`` means ``torch``. Layers are
joined only where each is a plain ``nn.Linear`` (``linear_view``: not a subclass, a
LoRA wrapper or our routed Linear) without hooks, all with one input width, parameter dtype and device, and
all with a bias or none; otherwise each runs as written.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from .._kernels._context import ProjectionsContext
from .._linear_view import linear_view
from .._ops._infra._fp8_gathered import Fp8Gathered
from .._ops._infra._launch import FLOAT_DTYPES, autocast_dtype
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp
from ._linear import timing_autocast
from ._lora import joinable_terms, lora_projections

__all__ = ["joined_halves", "projections"]

_grad_enabled = torch.is_grad_enabled
_deterministic = torch._C._get_deterministic_algorithms


def projections(input: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(input) for layer in layers)``: as one GEMM or each layer as written,
    as the policy's ``projections`` op decides, where the layers can be joined (see the
    module's text); otherwise each as written (what the forwards :func:`optimize` binds
    call in place of consecutive calls on one input)."""
    views = tuple(linear_view(layer) for layer in layers)
    if not _joinable(input, layers, views):
        group = joinable_terms(input, layers, views)
        if group is not None:  # LoRA layers: the lora_linear op runs them together
            return _value_apart(lora_projections(input, group))
        return tuple(layer(input) for layer in layers)
    weights = tuple(layer.weight for layer in layers)
    biases = tuple(layer.bias for layer in layers) if layers[0].bias is not None else ()
    return _value_apart(_projections(input, weights, biases))


def _value_apart(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Grouped-query attention's q, k and v, with v copied out of the joined output
    where it is a view of it that a backward will keep. Attention keeps v for its
    backward, and the rotary embedding makes q and k anew. A view would keep the whole
    output alive: 48 MiB a layer for v's 8 MiB on Llama-3.1-8B at T4096 (1.25 GiB over
    its 32 layers). Where v is as wide as q (BERT's attention, no rotary embedding),
    attention may keep q and k as views too, and the copy would add memory."""
    if len(outputs) != 3 or not _grad_enabled() or torch.compiler.is_compiling():
        return outputs
    q, k, v = outputs
    if v._base is None or not v.requires_grad or v.shape[-1] >= q.shape[-1]:
        return outputs
    return q, k, v.contiguous()


def joined_halves(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """The tensor that ``first`` and ``second`` are the two halves of (its last
    dimension), where they are views of one (the ``fused`` kernel's results for two
    layers of one width); else None (always while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return None  # addresses and offsets break a trace; the halves are taken as such
    base = first._base
    if (
        base is None
        or second._base is not base
        or base.dim() != first.dim()
        or first.shape != second.shape
        or base.shape[-1] != 2 * first.shape[-1]
        or not base.is_contiguous()
        or first.data_ptr() != base.data_ptr()
        or second.data_ptr() != base.data_ptr() + first.shape[-1] * base.element_size()
    ):
        return None
    return base


def _joinable(input: object, layers: tuple[nn.Module, ...], views: tuple) -> bool:
    if not isinstance(input, torch.Tensor) or len(layers) < 2:
        return False
    if (
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    ):
        return False  # a hook on every module's call: each layer must be called
    if not all(view is not None and view.dense for view in views):
        return False  # a LoRA adapter adds its term per call; a 4-bit base is dequantized
    first = layers[0]
    weight, has_bias = first.weight, first.bias is not None
    for layer in layers:
        if (
            layer._forward_hooks
            or layer._forward_pre_hooks
            or layer._backward_hooks
            or layer._backward_pre_hooks
            or (layer.bias is not None) != has_bias
            or (has_bias and layer.bias.dtype != weight.dtype)
        ):
            return False
        w = layer.weight
        if (
            type(w) not in (nn.Parameter, Fp8Gathered)  # (FSDP2's gathered in FP8)
            or w.shape[1] != weight.shape[1]
            or w.dtype != weight.dtype
            or w.device != weight.device
        ):
            return False
    if input.shape[-1:] != weight.shape[1:] or input.device != weight.device:
        return False
    # What F.linear would run: under autocast, on floats autocast casts (a float64 input
    # it leaves alone, and the layer then refuses it); otherwise, one dtype throughout.
    if autocast_dtype(input.device.type) is None:
        return input.dtype == weight.dtype
    return input.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES


# -- the op ----------------------------------------------------------------------------------
def _signature(input, weights, biases) -> tuple:
    return (
        input.shape,
        input.dtype,
        input.device,
        tuple(w.shape[0] for w in weights),
        weights[0].shape[1],
        weights[0].dtype,
        bool(biases),
        autocast_dtype(input.device.type) or input.dtype,
        _grad_enabled(),
        _deterministic(),
    )


def _context(input, weights, biases) -> ProjectionsContext:
    compute = autocast_dtype(input.device.type) or input.dtype
    sizes = tuple(w.shape[0] for w in weights)
    return ProjectionsContext(
        input, sum(sizes), compute, weights[0].dtype, bool(biases), _deterministic(),
        sizes=sizes,
    )  # fmt: skip


def _sample(ctx: ProjectionsContext, *call) -> tuple[tuple, list[torch.Tensor]]:
    """Fresh arguments shaped as ``ctx``."""
    x = torch.randn_like(ctx.input).requires_grad_(ctx.requires_grad)
    width = ctx.input.shape[-1]
    weights = tuple(
        (torch.randn(n, width, device=x.device) * width**-0.5)
        .to(ctx.param_dtype)
        .requires_grad_(ctx.requires_grad)
        for n in ctx.sizes
    )
    biases = tuple(
        torch.zeros(n, device=x.device, dtype=ctx.param_dtype).requires_grad_(ctx.requires_grad)
        for n in (ctx.sizes if ctx.has_bias else ())
    )
    return (x, weights, biases), [x, *weights, *biases]


_projections = RoutedOp(
    "projections",
    signature=_signature,
    context=_context,
    sample=_sample,
    around=timing_autocast,
    traced_auto=torch_under_compile,
    # Timed alone, three GEMMs can beat one joined GEMM; inside Gemma3-1B's step on an
    # H100 choosing them cost 23 ms (160 -> 183 ms).
    unmeasured="what joining saves lies after the op (one cast and one kept copy of the "
    "input; the per-head norms reading the joined output in place), not in its own time",
)

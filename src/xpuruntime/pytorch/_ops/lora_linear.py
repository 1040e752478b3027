"""A linear layer with a LoRA adapter as one op: ``y = x W^T + b + s (x A^T) B^T``.

peft's ``lora.Linear`` runs ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as
written: under autocast each of the three GEMMs casts ``x`` again and keeps its own copy
for the backward, the scale and the add are kernels of their own over the full output
width, and the backward forms ``dY B`` for ``dA`` and ``dx`` apart and adds the two input
gradients in another pass. Here (Unsloth's and LoRAFusion's arrangement, arXiv
2510.00206):

- forward: ``t = x A^T`` (rank wide, kept for ``dB``), ``y = x W^T + b`` by one GEMM,
  and ``s t B^T`` accumulated into ``y`` by a second GEMM's beta (no add kernel);
- backward: ``ds = s dY B`` once, reused for ``dA = ds^T x`` and for ``dx = ds A + dY W``
  (``ds A`` written first, ``dY W`` added onto it by the base GEMM's beta: ``dx`` read in
  that GEMM's epilogue, not by a second pass); ``dB = s dY^T t``; nothing is computed
  for a frozen base weight or bias.

The forward keeps the base's GEMM first and adds the term in a second pass. Made first,
the term would be rounded before the base adds: worse wherever an adapter's term is the
larger (BENCHMARKS.md, "The adapters' term").

The GEMMs are cuBLAS's (any device PyTorch runs on); ``x`` is cast once to the compute
dtype (autocast's where it is on) and kept once. With ``lora_dropout > 0`` the adapters'
GEMMs read ``x`` through their masks, drawn and applied inside Triton kernels and kept as
bits (:mod:`._infra._lora_dropout`): no dropped copy of ``x`` is made or kept, and ``dx``
takes each adapter's masked ``ds A`` in one pass. :func:`torch_lora_projections` draws
the masks as peft does (``F.dropout`` of ``x`` cast to the adapter's dtype, layer by
layer).

On CUDA the common training call (:func:`_native_call` says which) runs as one C++
autograd node (:file:`_infra/_lora_node.cpp`): the same GEMMs in the same order, called
from C++, without a Python node. In a plain loop over narrow layers the host is what the
step waits for, and this op's Python was most of it (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from ..._errors import UnsupportedOperationError
from ...kernels import dispatcher
from ._infra._capture_paths import capture_paths
from ._infra._constants import constant
from ._infra._first_order import first_order
from ._infra._fp8_handoff import handed_amax, handed_cast, mark_gradient_scales
from ._infra._fp8_weight import Fp8Weight, dense, dequantized, fp8_joined, fp8_scales
from ._infra._frozen_casts import frozen_cast
from ._infra._grad_targets import gradient_target, targeted
from ._infra._joined_storage import join_weights
from ._infra._launch import _TRITON_INSTALLED, autocast_dtype, mm_as
from ._infra._recompute import recomputable

__all__ = [
    "lora_projections",
    "quant_state",
    "torch_lora_linear",
    "torch_lora_projections",
    "weight_dtype",
    "weight_rows",
]


def quant_state(weight: Tensor) -> object | None:
    """bitsandbytes' 4-bit state of a base weight (a quantized ``Params4bit``, QLoRA's
    base), or None for a plain weight."""
    if not getattr(weight, "bnb_quantized", False):
        return None
    return getattr(weight, "quant_state", None)


def weight_rows(weight: Tensor) -> int:
    """A base weight's output features (a 4-bit weight is stored packed)."""
    state = quant_state(weight)
    return weight.shape[0] if state is None else state.shape[0]


def _columns(weight: Tensor) -> int:
    """A base weight's input features."""
    state = quant_state(weight)
    return weight.shape[1] if state is None else state.shape[1]


def weight_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a base weight computes in (a 4-bit weight's: what it dequantizes to)."""
    state = quant_state(weight)
    return weight.dtype if state is None else state.dtype


def _dense(weight: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``weight`` in ``dtype`` (a 4-bit one dequantized), into ``out`` where given."""
    state = quant_state(weight)
    if state is None:
        return weight.to(dtype) if out is None else out.copy_(weight)
    # Dequantized to the dtype bitsandbytes makes it in, then cast: its rounding.
    direct = out if out is not None and out.dtype == state.dtype else None
    dense = _dequantized(weight.data, state, direct)
    if out is None:
        return dense.to(dtype)
    return out if dense is direct else out.copy_(dense.view(out.shape))


def _dequantized(packed: Tensor, state: object, out: Tensor | None) -> Tensor:
    """A 4-bit weight dense in its ``state.dtype``: by our Triton pass over bitsandbytes'
    storage where Triton runs (into ``out`` where given), else by bitsandbytes."""
    from . import nf4

    if nf4.unsupported(packed, state, out) is None:
        if out is None:
            out = torch.empty(state.shape, dtype=state.dtype, device=packed.device)
        return nf4.run_dequantize_4bit(packed, state, out)
    from bitsandbytes import functional as bnb_functional

    if getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes repacks a weight for its CPU kernels on its first no-grad eval
        # call on an AVX512-BF16 CPU; its own inverse (what it runs before .cuda() and
        # saving) gives the layout dequantize_4bit reads. The module keeps its packing.
        packed, state = bnb_functional._convert_weight_packed_for_cpu_inverse(packed, state)
    return bnb_functional.dequantize_4bit(packed, state)  # (its out= fails under compile)


def lora_projections(
    x: Tensor,
    weights: tuple[Tensor, ...],
    biases: tuple[Tensor, ...],
    lora_as: tuple[Tensor, ...],
    lora_bs: tuple[Tensor, ...],
    scalings: tuple[float, ...],
    compute_dtype: torch.dtype | None = None,
    dropout: tuple[tuple[float, torch.dtype | None], ...] = (),
    fp8: str | None = None,
) -> tuple[Tensor, ...]:
    """LoRA layers of one input (one, or attention's q/k/v, an MLP's gate and up) as one
    node: each ``x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T``, by one GEMM
    over the joined base weights, one ``x [A_1 | A_2 | ...]^T`` and the block-diagonal
    ``diag(s_i B_i)`` step accumulated into the first GEMM's output; the results are
    views of that output.

    Parameters
    ----------
    x : Tensor
        (..., in_features).
    weights, biases : tuple of Tensor
        The base layers' (out_i, in) weights and (out_i,) biases (one per layer, or none).
    lora_as, lora_bs : tuple of Tensor or None
        The adapters' (rank_i, in) and (out_i, rank_i) weights; both None for a layer
        without an adapter (a frozen base peft left bare: its base GEMM alone, joined
        with the others').
    scalings : tuple of float
        Each adapter's ``lora_alpha / r`` (or peft's rsLoRA form).
    compute_dtype : torch.dtype, optional
        What the GEMMs run in (default: autocast's where it is on, else ``x``'s).
    dropout : tuple of (float, dtype or None), optional
        Each adapter's dropout probability (and the dtype peft casts its input to, which
        only :func:`torch_lora_projections` reads); none: no dropout. One probability
        and one rank for all adapters (:func:`._infra._lora_dropout.fits`).
    fp8 : {'tensorwise', 'rowwise'}, optional
        Run the base's output and input-gradient GEMMs with FP8 operands by this recipe
        (:mod:`.fp8`), the weight cast on each call. The adapters' GEMMs, and a
        training base's gradient, stay in the compute dtype. A base stored in FP8
        (:class:`._infra._fp8_weight.Fp8Weight`) is read as stored, with its scales per
        row, whatever the recipe (:func:`.fp8.stored_output_gemm`); without ``fp8`` it
        is dequantized on each call. A 4-bit base (QLoRA's) is made FP8 by rows on
        each call (:func:`.nf4.fp8_4bit`, not bf16) and read so.

    Raises
    ------
    UnsupportedOperationError
        A dropout the kernels do not draw, or FP8 GEMMs of a shape or base they do not
        take (the message says why).
    """
    dtype = compute_dtype or autocast_dtype(x.device.type) or x.dtype
    scales = tuple(float(s) for s in scalings)
    ranks = tuple(0 if a is None else a.shape[0] for a in lora_as)  # (0: no adapter)
    adapted = tuple(i for i, rank in enumerate(ranks) if rank)
    p, seed = _dropout_of(x, ranks, adapted, dropout) if dropout else (0.0, None)
    quantized = any(quant_state(w) is not None for w in weights)
    if fp8 is not None:
        _check_fp8(x, weights, fp8)
    in_fp8 = any(type(w) is Fp8Weight for w in weights)
    stored = fp8_joined(weights) if in_fp8 and fp8 is not None else None
    if quantized and fp8 is not None:  # (made FP8 by rows, read as a stored base)
        from .nf4 import fp8_4bit

        stored = fp8_4bit(weights)
    if stored is not None:
        base = stored  # (qdata, scale): the FP8 GEMMs read it as stored
    elif quantized or in_fp8:
        base = None  # dequantized on each call
    else:
        base = frozen_cast(weights, dtype, _join)  # a kept cast, or None
    sizes = tuple(weight_rows(w) if quantized else w.shape[0] for w in weights)
    layout = _Layout(sizes, ranks, scales, len(biases), quantized, adapted)
    joined = None
    if seed is None and fp8 is None and x.device.type in _NATIVE_DEVICES:
        joined = _native_call(x, dtype, layout, base, weights, lora_as, lora_bs)
    if joined is None:
        joined = _LoraJoined.apply(
            x, dtype, layout, p, seed, base, fp8, *weights, *biases, *lora_as, *lora_bs
        )
    if stored is not None and x.requires_grad:  # (the backward casts dY diag(scale))
        scales = fp8_scales
        if quantized:
            from .nf4 import fp8_4bit_scales as scales
        mark_gradient_scales(joined, functools.partial(scales, weights))
    if len(weights) == 1:  # one layer's output as it is: autograd undoes a split of one
        return (joined,)  # part by copying the whole gradient (a cat of one tensor)
    return _split(joined, layout.sizes, -1)


def _check_fp8(x: Tensor, weights: tuple[Tensor, ...], recipe: str) -> None:
    """(A 4-bit base the FP8 pass cannot make is refused by the pass, with its reason.)"""
    from .fp8 import refuse

    refuse("lora_projections", x, sum(weight_rows(w) for w in weights), recipe)


def _dropout_of(
    x: Tensor, ranks: tuple[int, ...], adapted: tuple[int, ...], dropout: tuple
) -> tuple[float, Tensor | None]:
    """The call's dropout probability and seed (0 and None without dropout), drawn for
    the ``adapted`` layers alone."""
    ps = tuple(float(dropout[i][0]) for i in adapted)
    if not any(ps):
        return 0.0, None
    from ._infra._lora_dropout import draw_seed, fits

    rows = x.numel() // max(1, x.shape[-1])
    why = fits(rows, x.shape[-1], tuple(ranks[i] for i in adapted), ps)
    if why is not None:
        raise UnsupportedOperationError(
            f"lora_projections: the kernels do not draw this dropout: {why}"
        )
    return ps[0], draw_seed(x.device)


def torch_lora_linear(
    x, weight, bias, lora_a, lora_b, scaling, compute_dtype=None, dropped=None
) -> Tensor:
    """The same as peft writes it (three ``F.linear``, a scale and an add; the adapter
    reads ``dropped``, its input after peft's dropout, where given); without an adapter
    (``lora_a`` None) the base layer alone."""
    F = torch.nn.functional
    xd = x if dropped is None else dropped
    if compute_dtype is not None:
        x, xd = x.to(compute_dtype), xd.to(compute_dtype)
        if lora_a is not None:
            lora_a, lora_b = lora_a.to(compute_dtype), lora_b.to(compute_dtype)
        bias = None if bias is None else bias.to(compute_dtype)
        if quant_state(weight) is None:
            weight = weight.to(compute_dtype)
    state = quant_state(weight)
    if state is None:
        base = F.linear(x, weight, bias)
    else:  # bitsandbytes' own 4-bit GEMM, as its Linear4bit runs it
        import bitsandbytes as bnb

        base = bnb.matmul_4bit(x.to(state.dtype), weight.t(), bias=bias, quant_state=state)
        base = base.to(x.dtype)
    if lora_a is None:
        return base
    return base + F.linear(F.linear(xd, lora_a), lora_b) * scaling


def torch_lora_projections(
    x, weights, biases, lora_as, lora_bs, scalings, compute_dtype=None, dropout=()
):
    """Each layer as peft writes it, its dropout drawn as peft draws it (layer by layer,
    on ``x`` cast to the adapter's dtype)."""
    bias = biases or (None,) * len(weights)
    outs = []
    for i, (w, b, a, lb, s) in enumerate(zip(weights, bias, lora_as, lora_bs, scalings)):
        dropped = None
        if dropout and dropout[i][0]:
            p, cast = dropout[i]
            xd = x if cast is None or x.dtype == cast else x.to(cast)
            dropped = torch.nn.functional.dropout(xd, p, training=True)
        outs.append(torch_lora_linear(x, w, b, a, lb, s, compute_dtype, dropped))
    return tuple(outs)


def _join(parts: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """``torch.cat(parts)`` in ``dtype`` (one copy; a single part only cast; 4-bit and
    FP8-stored parts dequantized)."""
    if any(type(p) is Fp8Weight for p in parts):
        stored = fp8_joined(parts)
        if stored is None:  # (some stored, some not)
            return torch.cat([dense(p).to(dtype) for p in parts])
        return dequantized(*stored, dtype)
    if any(quant_state(p) is not None for p in parts):
        from .nf4 import joined_4bit

        joined = joined_4bit(parts, dtype)  # one launch, its arguments kept
        if joined is not None:
            return joined
        # A half-precision state of another dtype (fp16 under bf16): made in its own dtype
        # by the same kept launch, then cast once (two roundings, as bitsandbytes makes).
        own = weight_dtype(parts[0])
        joined = joined_4bit(parts, own) if own != dtype else None
        if joined is not None:
            return joined.to(dtype)
        if len(parts) == 1:
            return _dense(parts[0], dtype)
        # Each part written into its rows of the joined weight: no copy to join them.
        rows = [weight_rows(p) for p in parts]
        joined = torch.empty(sum(rows), _columns(parts[0]), dtype=dtype, device=parts[0].device)
        for part, view in zip(parts, joined.split(rows)):
            _dense(part, dtype, out=view)
        return joined
    return join_weights(parts, dtype)


_NATIVE_DEVICES = ("cuda",)
"""Where the op's common call runs as the C++ node of :file:`_infra/_lora_node.cpp`
(its host cost is what a plain loop waits for on a GPU; the CPU tests add "cpu")."""
_PLAIN = (Tensor, torch.nn.Parameter)


def _native_call(
    x: Tensor,
    dtype: torch.dtype,
    layout: _Layout,
    base: Tensor | None,
    weights: tuple[Tensor, ...],
    lora_as: tuple[Tensor, ...],
    lora_bs: tuple[Tensor, ...],
) -> Tensor | None:
    """The joined layers' output from the C++ node (:file:`_infra/_lora_node.cpp`), or
    None where it does not take the call and :class:`_LoraJoined` runs it. It takes the
    common training call: every layer adapted, one scale, no bias, no dropout, no FP8, a
    frozen base, autocast off or in the compute dtype, plain tensors, autograd
    recording, no gradient targets (DDP's buckets), outside ``torch.compile``, CUDA-graph
    captures and the dispatch log. The node does the arithmetic :class:`_LoraJoined`
    does, GEMM for GEMM; it calls back into Python only to make the input, or dA, again
    from what its maker kept, and to join (or dequantize) the base again for the input
    gradient."""
    scales = layout.scales
    if (
        x.__class__ is not Tensor
        or layout.biases
        or len(layout.adapted) != len(scales)
        or scales.count(scales[0]) != len(scales)
        or not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or _dispatch_log.enabled
        or capture_paths(x.device)
        or any(w.requires_grad for w in weights)
        or any(t.__class__ not in _PLAIN for t in (*lora_as, *lora_bs))
        or targeted(lora_bs[0]) is not None
    ):
        return None
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) != dtype:
        return None
    node = _native_node()
    if node is None:
        return None
    with torch.no_grad():  # (the joins and packs below record nothing)
        w = _join(weights, dtype) if base is None else base
        a, diag = _packed(lora_as, lora_bs, scales, scales[0], layout.sizes, dtype)
    # A cast of dense weights is kept for the backward, as peft's layers keep theirs;
    # weights in the compute dtype are joined again there, a 4-bit base dequantized again.
    kept = not layout.quantized and any(q.dtype != dtype for q in weights)
    again = recomputable(x) if x.is_contiguous() else None
    return node.lora_forward(
        x, w, a, diag, list(lora_as), list(lora_bs), scales[0], list(layout.sizes),
        list(layout.ranks), None if kept else functools.partial(_join, weights, dtype),
        None if again is None else again.function, None if again is None else again.product,
        [] if again is None else list(again.inputs), lora_as[0].dtype, lora_bs[0].dtype,
    )  # fmt: skip


def _native_node() -> object | None:
    """The C++ node's module (:func:`._infra._native.lora_node`), or None."""
    return _native_module().lora_node()


@functools.cache
def _native_module() -> ModuleType:
    """:mod:`._infra._native`, imported once (it imports Triton)."""
    from ._infra import _native

    return _native


class _Layout(NamedTuple):
    """What a call's layers are, read once per call: each base's output width, each
    adapter's rank (0: a layer without one) and scale, how many biases, whether a base
    is 4-bit, and which layers have an adapter."""

    sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    biases: int
    quantized: bool
    adapted: tuple[int, ...]


class _LoraJoined(torch.autograd.Function):
    """The joined layers' output ``x W^T + b + t diag(s_i B_i)^T`` with ``t = x A^T``
    (with dropout ``p``: ``t_i = (x ⊙ m_i) A_i^T / (1 - p)``, the masks drawn from
    ``seed`` and kept as bits; with ``recipe``, ``x W^T`` and ``dY W`` by FP8 GEMMs).
    ``base``: the joined weights' kept cast, their FP8 storage ``(qdata, scale)`` (read
    by FP8 GEMMs), or None (joined, cast or dequantized here)."""

    @staticmethod
    def forward(ctx, x, dtype, layout, p, seed, base, recipe, *params):
        n, scales = len(layout.sizes), layout.scales
        weights, rest = params[:n], params[n:]
        biases, lora_as, lora_bs = rest[: layout.biases], rest[-2 * n : -n], rest[-n:]
        # Autocast would cast nothing here (every GEMM's operands are in the compute
        # dtype) unless it computes in another dtype than the call's: only then is it
        # turned off (a context costs the host as much as a launch). FP8 GEMMs' scales
        # and casts always run without it, as they were written and measured.
        with _autocast_off(x.device.type, dtype if recipe is None else None):
            rows = x.reshape(-1, x.shape[-1])
            if rows.dtype != dtype:
                rows = rows.to(dtype)
            stored = base if isinstance(base, tuple) else None
            w = None  # (a stored base: its FP8 GEMMs read qdata and scale)
            if stored is None:
                w = _join(weights, dtype) if base is None else base  # (a kept cast)
            # One scale for the group (peft's usual: one alpha and r) is applied by the
            # GEMMs' alpha, not by a kernel per adapter each way: t is made scaled (s x
            # A^T), so that dB = dY^T t needs no scale; ds = s dY B takes it by its alpha.
            # A layer without an adapter (a frozen base peft left bare) has zero rows in
            # diag(s_i B_i) and no rows in the joined A; with no adapter at all the op is
            # the base's GEMM alone.
            adapted = layout.adapted
            own_scales = tuple(scales[i] for i in adapted)
            same = bool(adapted) and own_scales.count(own_scales[0]) == len(adapted)
            shared = own_scales[0] if same else None
            a = diag = t = bits = None
            if adapted:
                a, diag = _packed(lora_as, lora_bs, scales, shared, layout.sizes, dtype)
            if adapted and seed is not None:  # the adapters read x through their masks
                from ._infra._lora_dropout import dropped_down

                rows, a = rows.contiguous(), a.contiguous()  # the kernels' layout (t unscaled)
                t, bits = dropped_down(rows, a, len(adapted), p, seed)
            elif adapted:
                t = _scaled_mm(rows, a.t(), 1.0 if shared is None else shared)
            # What each dB_i = s_i dY_i^T t_i still has to be scaled by.
            t_scales = (1.0,) * n if shared is not None and bits is None else scales
            # The output is made in the input's shape, so that its halves (an MLP's gate
            # and up) are views of a tensor of their own shape: the activation takes it
            # whole (projections.joined_halves), neither direction copying the halves.
            # (F.linear folds the leading dimensions into one GEMM and returns its output
            # reshaped, not a view.)
            bias = _join(biases, dtype) if biases else None
            if recipe is None:
                joined = torch.nn.functional.linear(rows.view(*x.shape[:-1], -1), w, bias)
            else:
                from .fp8 import new_output, output_gemm, stored_output_gemm

                joined, out = new_output(x, sum(layout.sizes), dtype)
                if stored is not None:
                    # (x's cast as its maker made it, where it handed one)
                    cast = handed_cast(x) if x.dtype == dtype else None
                    stored_output_gemm(rows, *stored, out=out, cast=cast)
                else:
                    output_gemm(rows, w, recipe, out=out)
                if bias is not None:
                    joined += bias
            if adapted:
                scale = shared if shared is not None and bits is not None else 1.0
                joined.view(-1, sum(layout.sizes)).addmm_(t, diag.t(), alpha=scale)
        # The joined base is kept where it is a cast of dense weights, as peft's layers
        # under autocast keep their cast weights. Weights already in the compute dtype (a
        # bf16 base, FSDP2's gathered ones) are joined again in the backward, and a 4-bit
        # base dequantized again, as bitsandbytes does (QLoRA's memory).
        kept = stored is None and not layout.quantized and any(q.dtype != dtype for q in weights)
        # An input the op before made from tensors its backward keeps anyway (a gated
        # MLP's activation, a norm's output) is made again in the backward, and cast as
        # here, not kept (ops._recompute).
        # A frozen base alone (no adapter, no dropout) reads only dY in the backward.
        reads_x = bool(adapted) or any(ctx.needs_input_grad[7 : 7 + n])
        again = recomputable(x) if reads_x and x.is_contiguous() else None
        ctx.again = None if again is None else again.function
        ctx.product = None if again is None else again.product
        sources = () if again is None else again.inputs
        ctx.save_for_backward(None if again or not reads_x else rows, w if kept else None, a,
                              diag, t, bits, *sources)  # fmt: skip
        ctx.rejoined = None if kept else weights
        ctx.p, ctx.ds_scale, ctx.t_scales = p, 1.0 if shared is None else shared, t_scales
        ctx.shape, ctx.layout = x.shape, layout
        some = adapted[0] if adapted else None  # (an adapter's: what their gradients are in)
        ctx.grad_dtypes = (
            (None, None) if some is None else (lora_as[some].dtype, lora_bs[some].dtype)
        )
        # Where the adapters' gradients go, if anywhere (DDP's buckets, the replicated
        # adapters' of ``shard``): each B's, and a single layer's A. A model's trained
        # parameters get targets together, so one look serves a model without them.
        first = None if some is None else targeted(lora_bs[some])
        ctx.targets = None if first is None else (
            targeted(lora_as[0]) if n == 1 else None,
            *(None if b is None else targeted(b) for b in lora_bs))  # fmt: skip
        # A stored base is joined again in the backward, not held from the forward.
        # Joining views of one stored tensor costs nothing. A group FSDP2 gathered
        # weight by weight is joined by a copy; held, every layer's copy would be alive
        # at once: the whole model's FP8 bytes, what sharding saves.
        ctx.compute, ctx.recipe, ctx.stored = dtype, recipe, stored is not None
        return joined

    @staticmethod
    @first_order("lora_linear")
    def backward(ctx, dy):
        incoming = dy  # (what its maker may have handed an amax of)
        rows, w, a, diag, t, bits, *sources = ctx.saved_tensors
        shape, layout = ctx.shape, ctx.layout
        sizes, ranks, n, n_bias = layout.sizes, layout.ranks, len(layout.sizes), layout.biases
        needs = ctx.needs_input_grad
        need_x = needs[0]
        need_w = any(needs[7 : 7 + n])
        need_b = n_bias and any(needs[7 + n : 7 + n + n_bias])
        need_a = any(needs[7 + n + n_bias : 7 + 2 * n + n_bias])
        a_dtype, b_dtype = ctx.grad_dtypes
        compute = ctx.compute
        targets = ctx.targets or (None,) * (n + 1)
        with _autocast_off(dy.device.type, None):  # (the backward's is off unless asked)
            dy = dy.reshape(-1, dy.shape[-1])
            if dy.dtype != compute:
                dy = dy.to(compute)
            adapted = layout.adapted
            ds = None  # (tokens, total rank): s_i dY_i B_i
            if adapted:
                ds = _scaled_mm(dy, diag, ctx.ds_scale)
            # An input made again is read by the adapters' gradient, a training base's
            # and dropout's. Where only the first needs it, its maker may give
            # dA = ds^T x without making x (a gated activation does, from gate and up).
            da = None
            if need_a and bits is None and not need_w and ctx.product is not None:
                da = ctx.product(ds, *sources)
            if ctx.again is not None and (need_w or bits is not None or (need_a and da is None)):
                rows = ctx.again(*sources).view(-1, shape[-1])
                if rows.dtype != compute:
                    rows = rows.to(compute)
            dx = None
            if w is None and not ctx.stored and (need_x or need_w):
                w = _join(ctx.rejoined, compute)
            if need_x:
                term = adapted and bits is None  # (the adapters read x itself)
                if ctx.recipe is None:  # ds A first: dY W adds onto it by its beta
                    dx = torch.mm(ds, a).addmm_(dy, w) if term else dy @ w
                else:
                    from .fp8 import input_grad_gemm, stored_input_grad_gemm

                    if ctx.stored:
                        columns = None
                        if layout.quantized:  # (made FP8 again, in the GEMM's layout)
                            from .nf4 import fp8_4bit

                            columns, scale = fp8_4bit(ctx.rejoined, columns=True)
                            qdata = None
                        else:
                            qdata, scale = fp8_joined(ctx.rejoined)
                        amax = handed_amax(incoming, scale) if incoming.dtype == compute else None
                        dx = stored_input_grad_gemm(dy, qdata, scale, amax, columns)
                    else:
                        dx = input_grad_gemm(dy, w, ctx.recipe)
                    if term:  # (FP8 GEMMs take no beta: a second pass)
                        dx.addmm_(ds, a)
            dws = (dy.t() @ rows).split(sizes) if need_w else (None,) * n
            dbs = dy.sum(0).split(sizes) if need_b else (None,) * n_bias
            if bits is not None:  # dx takes each masked ds_i A_i, in place
                from ._infra._lora_dropout import dropped_grads

                da = dropped_grads(dx, ds, rows, a, bits, ctx.p, need_a)
            elif da is not None:
                da = _cast(da, a_dtype)
            elif need_a:
                da = _adapter_grad(ds.t(), rows, 1.0, a_dtype, targets[0])
            own_ranks = [ranks[i] for i in adapted]
            das = [None] * n
            if da is not None:
                parts = (da,) if len(adapted) == 1 else _split(da, own_ranks, 0)
                for i, part in zip(adapted, parts):
                    das[i] = part
            # Each layer's dB = s_i dY_i^T t_i by a GEMM of its own, written whole in its
            # parameter's dtype (not a block of one (out, total rank) product, cast apart).
            dyt, targets = dy.t(), targets[1:]
            dlbs = [None] * n
            if n == 1 and adapted:
                dlbs[0] = _adapter_grad(dyt, t, ctx.t_scales[0], b_dtype, targets[0])
            elif adapted:  # (one split each: a slice costs the host as much as a small launch)
                parts = zip(_split(dyt, sizes, 0), ranks, ctx.t_scales, targets)
                t_parts = iter(_split(t, own_ranks, 1))
                for i, (dy_i, rank, s, target) in enumerate(parts):
                    if rank:
                        dlbs[i] = _adapter_grad(dy_i, next(t_parts), s, b_dtype, target)
        dx = None if dx is None else dx.view(shape)
        return (dx, None, None, None, None, None, None, *dws, *dbs, *das, *dlbs)


def _autocast_off(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast turned off where it is on in a dtype other than ``dtype`` (None: where it
    is on); else nothing (it then casts none of the op's operands, all in ``dtype``)."""
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != dtype:
        return torch.autocast(device_type, enabled=False)
    return _NOTHING


_NOTHING = contextlib.nullcontext()
_dispatch_log = dispatcher.log  # while on, calls go through our registered torch ops


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _packed(
    lora_as: tuple[Tensor | None, ...],
    lora_bs: tuple[Tensor | None, ...],
    scales: tuple[float, ...],
    shared: float | None,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The joined A of the layers with an adapter and the block diagonal
    ``diag(s_i B_i)`` (zero rows for a layer without one; ``s_i`` left to the GEMMs'
    alpha where ``shared``), in ``dtype``: by one Triton launch where it runs, else
    PyTorch's calls."""
    n = len(sizes)
    own = scales if shared is None else (1.0,) * n
    if n > 1 and _TRITON_INSTALLED:
        packed = _adapter_pack().pack_adapters(lora_as, lora_bs, own, dtype, sizes)
        if packed is not None:
            return packed
    a = _join(tuple(p for p in lora_as if p is not None), dtype)
    bs = [b if b is None or shared is not None else b * s for b, s in zip(lora_bs, scales)]
    return a, (_cast(bs[0], dtype) if n == 1 else _block_diagonal(bs, sizes, dtype))


@functools.cache
def _adapter_pack() -> ModuleType:
    """:mod:`._infra._adapter_pack`, imported once (it imports Triton; an import
    statement run on each call costs the host a few µs)."""
    from ._infra import _adapter_pack

    return _adapter_pack


def _block_diagonal(
    parts: list[Tensor | None], sizes: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """``torch.block_diag(*parts)`` in ``dtype``, a part of None ``sizes[i]`` zero rows
    and no columns: each part cast as it is copied into its block (one launch a part, not
    a cast and a copy)."""
    present = [p for p in parts if p is not None]
    out = present[0].new_zeros((sum(sizes), sum(p.shape[1] for p in present)), dtype=dtype)
    row = col = 0
    for p, size in zip(parts, sizes):
        if p is not None:
            out[row : row + size, col : col + p.shape[1]].copy_(p)
            col += p.shape[1]
        row += size
    return out


def _scaled_mm(a: Tensor, b: Tensor, alpha: float, dtype: torch.dtype | None = None) -> Tensor:
    """``alpha * a @ b`` by one GEMM (its alpha; no scaling kernel; beta 0: the empty
    input is never read), in ``dtype`` where given: on CUDA a 16-bit product is written
    in float32 by the GEMM itself (an adapter's gradient, accumulated in float32 and not
    rounded to 16 bits first); elsewhere cast after."""
    if dtype is None or dtype == a.dtype:
        return a @ b if alpha == 1.0 else torch.addmm(_unread(a), a, b, beta=0, alpha=alpha)
    if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        product = torch.mm(a, b, out_dtype=dtype)
        return product if alpha == 1.0 else product.mul_(alpha)
    return _scaled_mm(a, b, alpha).to(dtype)


def _adapter_grad(
    a: Tensor, b: Tensor, alpha: float, dtype: torch.dtype, parameter: Tensor | None
) -> Tensor:
    """:func:`_scaled_mm` for an adapter's gradient, written into the parameter's
    gradient target where it has one (:mod:`._infra._grad_targets`), not copied there
    after."""
    out = None
    if parameter is not None:
        out = gradient_target(parameter, torch.Size((a.shape[0], b.shape[1])), dtype)
    if out is None:
        return _scaled_mm(a, b, alpha, dtype)
    mm_as(a, b, dtype, out)
    return out if alpha == 1.0 else out.mul_(alpha)


# ``Tensor.split`` is a Python wrapper (torch function checks, then this call): the op
# splits up to four times a call, on the host's critical path in a plain loop.
_split = torch.split_with_sizes


def _unread(like: Tensor) -> Tensor:
    """A 0-dim tensor of ``like``'s device and dtype, for a GEMM input that beta 0 never
    reads (one kept per device and dtype: :func:`._infra._constants.constant`)."""
    key = ("unread", like.device, like.dtype)
    return constant(key, like.device, lambda: like.new_empty(()))

"""A linear layer with a LoRA adapter (peft's ``lora.Linear``, recognised by its
structure, :func:`~..._linear_view.linear_view`, and checked on a probe
input) runs as the ``lora_linear`` op: the low-rank term accumulated into the base GEMM,
one autograd node (:func:`ops.lora_linear.lora_projections`), unless the policy names ``torch`` for it.
The bound forward reads the layer's adapter state at each call (``set_adapter``,
``disable_adapter()``, merging, dropout on or off with the mode): a call the op does not
cover (DoRA, an adapter bias, several active adapters, extra arguments) runs peft's own
forward. A LoRA layer over another base (GPT-2's ``Conv1D``, a convolution, an 8-bit
layer, an embedding) runs as written, and the report says so. A bitsandbytes 4-bit
layer peft left without an adapter (its default targets adapt q_proj and v_proj alone)
runs as the same op without a term: its base made dense by our pass and one GEMM,
joined with its group's layers where they run together."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._functional._lora import LoraTerm, bitsandbytes_row, fits, lora_linear, lora_term
from ..._linear_view import linear_view
from ..._ops.lora_linear import quant_state
from .._report import Finding
from .._run import Run

FUSED = Finding(
    "fused_loras", "LoRA layer(s)", "{}: its adapter runs with its base layer as one op",
    listed_when_empty=False,
    doc="peft LoRA layers whose adapter runs with its base layer as ``lora_linear``",
)  # fmt: skip


BARE = Finding(
    "bare_4bit_layers", "4-bit layer(s) without an adapter",
    "{}: a 4-bit layer without an adapter, run by the lora_linear op",
    listed_when_empty=False,
    doc="bitsandbytes 4-bit layers peft left without an adapter, run by ``lora_linear`` as their base alone (joined with their group, their gated MLP fused)",
)  # fmt: skip


class Lora:
    findings = (FUSED, BARE)

    def enabled(self, run: Run) -> bool:
        return run.fuses("lora_linear")

    def apply(self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module) -> bool:
        view = linear_view(module)
        if view is None:
            base = _unread_base(module)
            if base is None:
                return False
            kind = type(base).__name__
            run.skip(path, f"{type(module).__name__}: its base, {kind}, is not nn.Linear or "
                     "bitsandbytes' Linear4bit; runs as written")  # fmt: skip
            return True
        if view.dense:
            return False
        if view.plain:  # a 4-bit layer without an adapter (not a LoRA layer's base)
            if getattr(parent, "base_layer", None) is module:
                return False
            run.bind(module, _bare_forward(type(module).forward))
            run.joined.add(id(module))
            run.report.add(BARE, [path])
            return True
        term = lora_term(module)
        if isinstance(term, str):
            run.skip(path, f"{type(module).__name__}: {term}; runs as written")
            return True
        why = _probe(module, view.base, term)
        if why is not None:
            run.skip(path, f"{type(module).__name__} {why}; runs as written")
            return True
        run.bind(module, _forward(type(module).forward))
        run.joined.update(map(id, (view.base, term.a, term.b)))  # the lora_linear op's GEMMs
        run.report.add(FUSED, [path])
        return True


def _unread_base(module: nn.Module) -> nn.Module | None:
    """The base of a LoRA layer whose base the op does not read (transformers' ``Conv1D``,
    GPT-2's (in, out) weight), else None."""
    base = getattr(module, "base_layer", None)
    adapters = getattr(module, "lora_A", None)
    return base if isinstance(base, nn.Module) and isinstance(adapters, nn.ModuleDict) else None


def _forward(written: Any):
    """The layer's forward: the ``lora_linear`` op where its adapter state and the call
    allow, else ``written`` (peft's own)."""

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        term = lora_term(self)
        if args or kwargs or isinstance(term, str) or not fits(x, self.base_layer, term):
            return written(self, x, *args, **kwargs)
        return lora_linear(x, self.base_layer, term)

    return forward


def _bare_forward(written: Any):
    """A 4-bit layer's forward without an adapter: the ``lora_linear`` op over its base
    alone where the call allows, else ``written`` (bitsandbytes' own; for a generated
    token too: :func:`bitsandbytes_row`)."""

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not fits(x, self, None) or bitsandbytes_row(x):
            return written(self, x, *args, **kwargs)
        return lora_linear(x, self, None)

    return forward


def _probe(module: nn.Module, base: nn.Module, term: LoraTerm) -> str | None:
    """None where ``module`` computes ``base(x) + scaling * B(A(x))`` on a probe input
    (with a nonzero B, as trained adapters have), else what it computes instead."""
    weight = base.weight
    # A 4-bit base computes in any float dtype: the probe takes the adapter's.
    dtype = weight.dtype if quant_state(weight) is None else term.a.weight.dtype
    if weight.device.type == "meta" or not dtype.is_floating_point:
        return "has no weights to probe"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, base.in_features, generator=generator).to(weight.device, dtype)
    b = torch.randn(term.b.weight.shape, generator=generator).to(weight.device, dtype)
    saved, training = term.b.weight.detach().clone(), module.training
    try:
        module.eval()  # dropout off: the probe compares what is computed, not what is drawn
        with torch.no_grad():
            term.b.weight.copy_(b)
            got = module(x)
            # peft's order: the adapter in its own dtype (fp32 over a bf16 base, as peft
            # upcasts adapters by default), the sum in the base's.
            written = base(x)
            low_rank = term.b(term.a(x.to(term.a.weight.dtype))) * term.scaling
            want = (written + low_rank).to(written.dtype)
    finally:
        module.train(training)
        with torch.no_grad():
            term.b.weight.copy_(saved)
    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3):
        return "computes something other than base(x) + scaling * B(A(x)) (checked on a probe)"
    return None


PATTERN = Lora()

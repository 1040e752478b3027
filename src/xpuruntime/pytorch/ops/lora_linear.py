"""A linear layer with a LoRA adapter as one op: ``y = x W^T + b + s (x A^T) B^T``.

peft's ``lora.Linear`` runs ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as
written: under autocast each of the three GEMMs casts ``x`` again and keeps its own copy
for the backward, the scale and the add are kernels of their own over the full output
width, and the backward forms ``dY B`` for ``dA`` and ``dx`` apart and adds the two input
gradients in another pass. Here (Unsloth's and LoRAFusion's arrangement, arXiv
2510.00206):

- forward: ``t = x A^T`` (rank wide, kept for ``dB``), ``y = x W^T + b`` by one GEMM,
  and ``s t B^T`` accumulated into ``y`` by the GEMM's beta (no add kernel);
- backward: ``ds = s dY B`` once, reused for ``dA = ds^T x`` and for ``dx = dY W + ds A``
  (one accumulation into the first GEMM's output); ``dB = s dY^T t``; nothing is
  computed for a frozen base weight or bias.

The GEMMs are cuBLAS's (any device PyTorch runs on); ``x`` is cast once to the compute
dtype (autocast's where it is on) and kept once. Dropout is not part of the op: a layer
with ``lora_dropout > 0`` runs as peft writes it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["lora_linear", "torch_lora_linear"]


def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T`` as one autograd node.

    Parameters
    ----------
    x : Tensor
        (..., in_features).
    weight, bias : Tensor
        The base layer's (out, in) weight and (out,) bias (or None).
    lora_a, lora_b : Tensor
        The adapter's (rank, in) and (out, rank) weights.
    scaling : float
        ``lora_alpha / r`` (or peft's rsLoRA form).
    compute_dtype : torch.dtype, optional
        What the GEMMs run in (default: ``x``'s dtype); autocast's where it is on.
    """
    dtype = compute_dtype or x.dtype
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling), dtype)


def torch_lora_linear(x, weight, bias, lora_a, lora_b, scaling, compute_dtype=None) -> Tensor:
    """The same as peft writes it (three ``F.linear``, a scale and an add)."""
    F = torch.nn.functional
    if compute_dtype is not None and compute_dtype != x.dtype:
        x, weight, lora_a, lora_b = (t.to(compute_dtype) for t in (x, weight, lora_a, lora_b))
        bias = None if bias is None else bias.to(compute_dtype)
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_a), lora_b) * scaling


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, dtype):
        with torch.autocast(x.device.type, enabled=False):
            rows = x.reshape(-1, x.shape[-1]).to(dtype)
            w, a, b = weight.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
            t = rows @ a.t()  # (tokens, rank)
            if bias is None:
                out = rows @ w.t()
            else:
                out = torch.addmm(bias.to(dtype), rows, w.t())
            out.addmm_(t, b.t(), alpha=scaling)
        ctx.save_for_backward(rows, w, a, b, t)
        ctx.scaling = scaling
        ctx.shape = x.shape
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        rows, w, a, b, t = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.reshape(-1, dy.shape[-1]).to(rows.dtype)
            ds = (dy @ b).mul_(ctx.scaling)  # (tokens, rank), for dA and dx alike
            dx = dw = db = da = dlb = None
            if need_x:
                dx = (dy @ w).addmm_(ds, a).view(ctx.shape)
            if need_w:
                dw = dy.t() @ rows
            if need_b and ctx.has_bias:
                db = dy.sum(0)
            if need_a:
                da = ds.t() @ rows
            if need_lb:
                dlb = torch.mm(dy.t(), t).mul_(ctx.scaling)
        return dx, dw, db, da, dlb, None, None

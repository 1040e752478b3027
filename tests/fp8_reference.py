"""What the FP8 LoRA tests share: the float64 reference of a GEMM whose first operand is
cast to e4m3 per row as the op's casts make it, and one bf16-autocast training step of a
peft model that gives its loss and its adapters' gradients."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def emulated_rows(a: torch.Tensor, b_quantized: torch.Tensor) -> torch.Tensor:
    """``a @ b_quantized`` in float64 with ``a`` (fp32) quantized to e4m3 per row first,
    as the casts of activations are made (multiplied by ``448 / amax`` in fp32)."""
    amax = a.abs().amax(1, keepdim=True).clamp(min=1e-12)
    q = (a * (torch.full_like(amax, 448.0) / amax)).clamp(-448, 448).to(E4M3)
    return (q.double() * (amax.double() / 448)) @ b_quantized


def lora_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward and backward of ``model`` on ``ids`` (the labels too) under bf16
    autocast: the loss and every adapter's gradient, flat, in fp32 (then zeroed)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for n, p in model.named_parameters()
                       if "lora_" in n])  # fmt: skip
    model.zero_grad()
    return loss.item(), grads

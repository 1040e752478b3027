"""Weight gradients computed in DDP's buckets (``data_parallel``'s default) against DDP
copying them there (``gradients_in_buckets=False``); run by tests/test_distributed.py
under torchrun, gloo, with the Triton interpreter (our ops on the CPU).

A transformers Llama with a tied head, optimized, twice from the same weights. Each rank
trains batches of its own; AdamW steps; a step of two micro-batches under ``no_sync``.
Prints, per rank: the largest relative gradient and parameter differences per step, and
the parameters whose gradient DDP copied into its buckets in each backward (seen under a
dispatch mode: a ``copy_`` or ``mul.out`` reading a ``.grad``).

    torchrun --nproc_per_node 2 tests/jobs/bucket_gradients.py [--ddp static|plain|unused]
        [--model llama|checkpointed|lora|linear]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import SMALL

from xpuruntime import pytorch as xpt

FORMS = {  # how DDP is built: it rebuilds its buckets at the third step, the second, never
    "static": {},
    "plain": {"static_graph": False},
    "unused": {"static_graph": False, "find_unused_parameters": True},
}


MODELS = ("llama", "checkpointed", "lora", "linear")
"""The model: optimized by default; with gradient checkpointing; peft LoRA on every
linear layer; every linear layer ``ops.fused_linear`` (the policy's ``linear`` named)."""


class Copies(TorchDispatchMode):
    """The parameters whose gradient was copied (``copy_`` or ``mul.out``, DDP's copies into
    its buckets) while it was active: a write whose source is a parameter's ``.grad``."""

    def __init__(self, named: dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self.named = named
        self.copied: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.mul.out):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            for name, p in self.named.items():
                if p.grad is not None and p.grad.data_ptr() == source.data_ptr():
                    self.copied.add(name)
        return func(*args, **kwargs)


def build(
    in_buckets: bool, options: dict, kind: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    xpt.optimize(model, {"kernels": {"linear": "fused"}} if kind == "linear" else None)
    wrapped = xpt.distributed.data_parallel(model, gradients_in_buckets=in_buckets, **options)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def backward(model, ids) -> list[str]:
    """The loss's backward; the names of the parameters whose gradient was copied."""
    copies = Copies(dict(model.module.named_parameters()))
    with copies:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return sorted(copies.copied)


def largest(pairs) -> float:
    """The largest difference of the pairs, relative to the largest value (a frozen
    parameter's gradients, None on both sides, skipped)."""
    worst, scale = 0.0, 0.0
    for a, b in pairs:
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise SystemExit("a gradient on one side only")
        worst = max(worst, float((a - b).abs().max()))
        scale = max(scale, float(b.abs().max()))
    return worst / max(scale, 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", choices=sorted(FORMS), default="static")
    parser.add_argument("--model", choices=MODELS, default="llama")
    args = parser.parse_args()
    options = FORMS[args.ddp]
    xpt.distributed.init_distributed("gloo")
    rank = xpt.distributed.rank()
    ours, our_opt = build(True, options, args.model)
    theirs, their_opt = build(False, options, args.model)
    generator = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randint(0, SMALL["vocab_size"], (2, 6), generator=generator) for _ in range(7)]
    steps = []
    for step in range(5):  # plain steps: zero_grad(set_to_none=True), backward, AdamW
        copied = {}
        for name, model in (("ours", ours), ("theirs", theirs)):
            model.zero_grad(set_to_none=True)
            copied[name] = backward(model, batches[step])
        grads = largest((p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))
        our_opt.step(), their_opt.step()
        params = largest(zip(ours.parameters(), theirs.parameters()))
        steps.append({"grads": grads, "params": params, "copied": copied})
    for model in (ours, theirs):  # two micro-batches, the first under no_sync
        model.zero_grad(set_to_none=True)
        with model.no_sync():
            backward(model, batches[5])
        backward(model, batches[6])
    grads = largest((p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))
    trained = sorted(n for n, p in ours.module.named_parameters() if p.requires_grad)
    print(json.dumps({"rank": rank, "steps": steps, "accumulated": grads,
                      "trained": trained}), flush=True)  # fmt: skip
    torch.distributed.barrier()  # out without gloo's teardown (see lora_ranks.py)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

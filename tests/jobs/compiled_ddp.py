"""torch.compile over ``data_parallel``'s DDP (a static graph) of an optimized model that
computes its loss from labels, against the same model and DDP run eagerly; run by
tests/test_distributed.py under torchrun, gloo, with the Triton interpreter.

DDP's output hooks run in a frame of their own that takes the model's outputs, the
deferred logits among them: dynamo copies an input's layout into its fake tensor, and
failed its own guard there while the logits answered layout queries from values made
for them. Prints, per rank: the largest loss and gradient differences over three steps
(SGD; with ``--sharded``, AdamW split over the ranks by ``shard_optimizer`` on both
sides), and whether the compiled model's logits stayed deferred.

    torchrun --nproc_per_node 2 tests/jobs/compiled_ddp.py [--sharded] [--cuda]
        [--checkpointed | --lora [--replicated]]

``--checkpointed``: with gradient checkpointing; ``--lora``: peft LoRA on every linear
layer (the adapters trained); ``--replicated``: those kept whole on every rank without
DDP (``data_parallel``'s ``replicate_trained``, its own choice for a LoRA model of
real size; this tiny one's adapters are 14% of it).

With ``--cuda``: one GPU per rank, NCCL, our GPU kernels, inductor.
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import SMALL

from xpuruntime import pytorch as xpt
from xpuruntime.pytorch._functional._lm_head import DeferredLogits


def build(sharded: bool, device: torch.device):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    if "--checkpointed" in sys.argv:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "--lora" in sys.argv:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    xpt.optimize(model)
    wrapped = xpt.distributed.data_parallel(
        model, replicate_trained=True if "--replicated" in sys.argv else None
    )
    if not sharded:
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), config
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    xpt.distributed.shard_optimizer(wrapped, optimizer)
    return wrapped, optimizer, config


def main() -> None:
    cuda = "--cuda" in sys.argv
    xpt.distributed.init_distributed("nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sharded = "--sharded" in sys.argv
    eager, eager_opt, config = build(sharded, device)
    compiled_model, compiled_opt, _ = build(sharded, device)
    compiled = torch.compile(compiled_model, backend="inductor" if cuda else "aot_eager")
    generator = torch.Generator().manual_seed(rank)
    losses, grads, deferred = 0.0, 0.0, True
    for _ in range(3):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator).to(device)
        want = eager(input_ids=ids, labels=ids)
        got = compiled(input_ids=ids, labels=ids)
        deferred = deferred and isinstance(got.logits, DeferredLogits)
        want.loss.backward()
        got.loss.backward()
        losses = max(losses, float((want.loss - got.loss).abs()))
        for a, b in zip(eager.parameters(), compiled_model.parameters()):
            if a.grad is None and b.grad is None:  # frozen (LoRA's base)
                continue
            grads = max(grads, float((a.grad - b.grad).abs().max()))
        for optimizer in (eager_opt, compiled_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"rank": rank, "loss": losses, "grads": grads, "deferred": deferred}))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: a gloo rank can idle there under load


if __name__ == "__main__":
    main()

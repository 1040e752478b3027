"""A tied embedding's gradient under ``xpt.distributed.data_parallel``, exchanged as rows,
against DDP reducing it whole (run by tests/test_distributed.py under torchrun, gloo).

A transformers model with a tied head (Llama, or Gemma3 whose lookup is a scaled
subclass), optimized, twice from the same weights: one copy spread with
``data_parallel(model)``, one with ``data_parallel(model, embedding_rows=False)``. Each
rank trains batches of its own shape (the ranks send different row counts), with the
padding token among the ids; a step of two micro-batches under ``no_sync``; then
compiled. Prints, per rank, the largest gradient difference over every parameter of
each step, and whether the exchange was installed.

    torchrun --nproc_per_node 2 tests/jobs/embedding_rows.py llama|gemma3_text [--plain]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import SMALL

from xpuruntime import pytorch as xpt


def build(family: str, rows: bool, options: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **SMALL, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    xpt.optimize(model)
    return xpt.distributed.data_parallel(model, embedding_rows=rows, **options)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    worst, scale = 0.0, 0.0
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise SystemExit(f"{name}: a gradient on one side only")
        if p.grad is not None:
            worst = max(worst, float((p.grad - q.grad).abs().max()))
            scale = max(scale, float(q.grad.abs().max()))
    return worst / max(scale, 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("--plain", action="store_true", help="no static graph, grads copied")
    args = parser.parse_args()
    # DDP as most write it: its reductions' finish queued when the last bucket is ready.
    options = {"static_graph": False, "gradient_as_bucket_view": False} if args.plain else {}
    xpt.distributed.init_distributed("gloo")
    rank = xpt.distributed.rank()
    ours, theirs = build(args.family, True, options), build(args.family, False, options)
    exchanged = "forward" in ours.module.model.embed_tokens.__dict__
    untouched = "forward" not in theirs.module.model.embed_tokens.__dict__
    generator = torch.Generator().manual_seed(10 + rank)
    # Each rank its own shape; the padding id (0) among the tokens.
    batches = [torch.randint(0, SMALL["vocab_size"], (1 + rank, 5 + 3 * rank), generator=generator)
               for _ in range(3)]  # fmt: skip
    differences = []
    for model in (ours, theirs):  # a plain step
        model.zero_grad(set_to_none=True)
        loss_of(model, batches[0]).backward()
    differences.append(largest_difference(ours, theirs))
    for model in (ours, theirs):  # two micro-batches, the first under no_sync
        model.zero_grad(set_to_none=True)
        with model.no_sync():
            loss_of(model, batches[1]).backward()
        loss_of(model, batches[2]).backward()
    differences.append(largest_difference(ours, theirs))
    compiled = {id(m): torch.compile(m, backend="aot_eager") for m in (ours, theirs)}
    for model in (ours, theirs):  # compiled: the lookup as written, DDP reduces it whole
        model.zero_grad(set_to_none=True)
        loss_of(compiled[id(model)], batches[0]).backward()
    differences.append(largest_difference(ours, theirs))
    with torch.no_grad():  # no backward, no exchange
        same = torch.equal(loss_of(ours, batches[0]), loss_of(theirs, batches[0]))
    print(json.dumps({"rank": rank, "exchanged": exchanged and untouched,
                      "differences": differences, "eval_equal": same}), flush=True)  # fmt: skip
    torch.distributed.barrier()  # out without gloo's teardown (see lora_ranks.py)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

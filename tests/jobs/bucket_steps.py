"""An optimizer stepped per DDP bucket inside the backward
(``xpt.distributed.data_parallel(model, optimizer=...)``) against the same optimizer
stepped after it (run by tests/test_distributed.py under torchrun, gloo).

A transformers Llama with a tied head, optimized, twice from the same weights, each
with its own AdamW and a warm-up schedule: one copy spread with the optimizer, one
without. Two plain steps, then a step of two micro-batches (the first under
``no_sync``, where DDP runs no hook). Each rank trains batches of its own shape. Prints,
per rank, the largest parameter difference after each step, which parameters each
backward moved (before ``optimizer.step()``), how many times the
optimizer's own step hook ran, whether both optimizers hold state for every parameter,
and what the refused constructions said.

    torchrun --nproc_per_node 2 tests/jobs/bucket_steps.py gloo|nccl
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import SMALL

import xpuruntime as xrt
from xpuruntime import pytorch as xpt


def build(
    stepped: bool, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    xpt.optimize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = xpt.distributed.data_parallel(model, optimizer=optimizer if stepped else None)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
    return wrapped, optimizer, warm_up


def refusals(device: torch.device) -> list[str]:
    said = []
    model = torch.nn.Linear(4, 4, device=device)
    for optimizer, options in [
        (torch.optim.LBFGS(model.parameters()), {}),
        (torch.optim.SGD(model.parameters(), lr=0.1), {"gradient_as_bucket_view": False}),
    ]:
        try:
            xpt.distributed.data_parallel(model, optimizer=optimizer, **options)
        except xrt.InvalidInputError as e:
            said.append(str(e))
    return said


def main() -> None:
    backend = sys.argv[1]
    xpt.distributed.init_distributed(backend)
    rank = xpt.distributed.rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    ours, theirs = build(True, device), build(False, device)
    hook_runs = [0]
    ours[1].register_step_pre_hook(lambda *_: hook_runs.__setitem__(0, hook_runs[0] + 1))
    generator = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randint(0, SMALL["vocab_size"], (1 + rank, 5 + 3 * rank), generator=generator).to(device)
               for _ in range(4)]  # fmt: skip
    plans = [[(batches[0], True)], [(batches[1], True)], [(batches[2], False), (batches[3], True)]]
    differences, moved_in_backward = [], []
    for plan in plans:
        for model, optimizer, schedule in (ours, theirs):
            before = [p.detach().clone() for p in model.module.parameters()]
            for ids, sync in plan:
                with model.no_sync() if not sync else torch.enable_grad():
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            if model is ours[0]:  # which parameters the backward itself stepped
                moved_in_backward.append([
                    name for (name, p), q in zip(model.module.named_parameters(), before)
                    if not torch.equal(p, q)
                ])  # fmt: skip
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
        differences.append(max(
            float((p - q).abs().max())
            for p, q in zip(ours[0].module.parameters(), theirs[0].module.parameters())
        ))  # fmt: skip
    ids = batches[0]
    try:  # clipping reads the gradients after the backward has stepped with them
        xpt.make_train_step(ours[0], lambda out, y: out.loss, ours[1], ((ids,), ids),
                            max_grad_norm=1.0)  # fmt: skip
    except xrt.InvalidInputError as e:
        said_by_step = str(e)
    every = all(len(o[1].state) == len(list(o[0].module.parameters())) for o in (ours, theirs))
    print(json.dumps({"rank": rank, "differences": differences, "hook_runs": hook_runs[0],
                      "moved_in_backward": moved_in_backward,
                      "parameters": [n for n, _ in ours[0].module.named_parameters()],
                      "state_for_every_parameter": every, "refusals": refusals(device),
                      "clipped_step": said_by_step}),
          flush=True)  # fmt: skip
    torch.distributed.barrier()  # out without gloo's teardown (see lora_ranks.py)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The optimizer split over DDP's ranks (``shard_optimizer``) against the same optimizer
stepping every parameter on every rank; run by tests/test_distributed.py under torchrun,
gloo, with the Triton interpreter (our ops on the CPU).

A transformers Llama with a tied head, optimized, in small DDP buckets (parameters cut
where a rank's share ends), twice from the same weights: two parameter groups (no weight
decay on the norms), a learning-rate schedule, gradients clipped. Each rank trains
batches of its own; then a step of two micro-batches under ``no_sync``. Prints, per rank
and step: whether the split had begun, the largest gradient difference before the step,
the largest logits difference of a forward right after it (which waits for the gathers
itself), every other step the parameters' after ``wait_for_parameters``, the largest parameter difference in the model's ``state_dict``, and the
optimizer state's elements on each side; the sharded optimizer's ``state_dict`` against the
whole one's, and a step after loading the whole one's into it; and what
``shard_optimizer`` refuses.

    torchrun --nproc_per_node 2 tests/jobs/optimizer_shards.py [--optimizer adamw|sgd]
        [--device cpu|cuda] [--model llama|checkpointed|lora|fp8]

On ``cuda`` one GPU per rank, NCCL, our GPU kernels.
"""

import argparse
import copy
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

OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-1, momentum=0.9, weight_decay=0.1),
}


MODELS = ("llama", "checkpointed", "lora", "fp8")
"""The model: optimized; with gradient checkpointing; peft LoRA on every linear layer (the
optimizer over the adapters alone, the frozen base in no bucket); optimized under
``precision="fp8"``, every linear layer's GEMMs FP8 (on the CPU: PyTorch's
``_scaled_mm``, the device check and the size table set aside)."""


def build(sharded: bool, kind: str, device: torch.device, form: str):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    if form == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if form == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    xpt.optimize(model, {"precision": "fp8"} if form == "fp8" else None)
    small = 0.002 if form == "lora" else 0.01  # buckets of ~2 KB (the adapters) or ~10 KB
    wrapped = xpt.distributed.data_parallel(model, bucket_cap_mb=small)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() > 1]},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    optimizer = OPTIMIZERS[kind](groups)
    if sharded:
        xpt.distributed.shard_optimizer(wrapped, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return wrapped, optimizer, schedule


def largest(pairs) -> float:
    worst = 0.0
    for a, b in pairs:
        if a is not None or b is not None:  # a frozen parameter's gradients: None on both
            worst = max(worst, float((a - b).abs().max()))
    return worst


def state_elements(optimizer) -> int:
    return sum(
        v.numel() for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )  # fmt: skip


def compare_state_dicts(ours: dict, theirs: dict) -> dict:
    """Whether the sharded optimizer's state_dict is the whole one's: its groups, which
    parameters hold state and under which keys, and the largest difference of a value."""
    strip = [{k: v for k, v in g.items()} for g in ours["param_groups"]]
    keys = {i: sorted(e) for i, e in ours["state"].items()}
    worst = 0.0
    for i, entries in theirs["state"].items():
        for key, value in entries.items():
            other = ours["state"].get(i, {}).get(key)
            if other is None:
                return {"groups": False, "keys": False, "largest": None}
            difference = (torch.as_tensor(other).cpu().double() - value.cpu().double()).abs()
            worst = max(worst, float(difference.max()))
    return {
        "groups": strip == theirs["param_groups"],
        "keys": keys == {i: sorted(e) for i, e in theirs["state"].items()},
        "largest": worst,
    }


def refusals(model, device) -> list[str]:
    """What shard_optimizer says to what it cannot split."""
    said = []
    plain = torch.nn.Linear(4, 4).to(device)
    attempts = [
        (plain, torch.optim.AdamW(plain.parameters())),  # not data_parallel's
        (model, torch.optim.LBFGS(model.parameters())),  # not element-wise
        (model, torch.optim.AdamW([torch.zeros(3, requires_grad=True)])),  # not the model's
        (model, xpt.distributed.shard_optimizer(model, torch.optim.SGD(model.parameters()))),
    ]
    for wrapped, optimizer in attempts:
        try:
            xpt.distributed.shard_optimizer(wrapped, optimizer)
        except xrt.InvalidInputError as error:
            said.append(str(error))
    if device.type == "cpu":  # the copy engines asked for where there are none
        try:
            xpt.distributed.shard_optimizer(
                model, torch.optim.AdamW(model.parameters()), copy_engines=True
            )
        except xrt.InvalidInputError as error:
            said.append(str(error))
    fused = xpt.distributed.shard_optimizer(
        model, torch.optim.AdamW(model.parameters(), fused=True)
    )
    scaler = torch.amp.GradScaler(device.type)  # each rank would see its share's infinities
    ids = torch.ones(1, 4, dtype=torch.long, device=device)
    scaler.scale(model(input_ids=ids, labels=ids, use_cache=False).loss).backward()
    try:
        scaler.step(fused)
    except xrt.InvalidInputError as error:
        said.append(str(error))
    if device.type == "cuda":  # a graphed step (CUDA only) cannot replay the gathers
        try:
            loss = lambda out, y: out.logits.sum()  # noqa: E731
            xpt.make_graphed_train_step(model, loss, attempts[-1][1], (1, 1))
        except xrt.InvalidInputError as error:
            said.append(str(error))
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=MODELS, default="llama")
    args = parser.parse_args()
    if args.model == "fp8":
        from xpuruntime.pytorch._kernels import fp8

        fp8.FP8_MIN_TOKENS = fp8.FP8_MIN_WEIGHT = 0
        if args.device == "cpu":
            fp8.fp8_refusal = lambda device: None
    xpt.distributed.init_distributed("nccl" if args.device == "cuda" else "gloo")
    rank = xpt.distributed.rank()
    device = (
        torch.device(args.device, torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    ours, our_opt, our_schedule = build(True, args.optimizer, device, args.model)
    theirs, their_opt, their_schedule = build(False, args.optimizer, device, args.model)
    generator = torch.Generator().manual_seed(10 + rank)
    fp8 = args.model == "fp8"  # bf16 autocast, 16 tokens a call (FP8 GEMMs' multiple)
    batches = [
        torch.randint(0, SMALL["vocab_size"], (2, 8 if fp8 else 6), generator=generator).to(device)
        for _ in range(9)
    ]
    probe = torch.randint(
        0, SMALL["vocab_size"], (1, 16 if fp8 else 5), generator=torch.Generator().manual_seed(3)
    ).to(device)
    steps = []
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=fp8)

    def step(micro):
        with autocast:
            compared_step(micro)

    def compared_step(micro):
        for model, optimizer in ((ours, our_opt), (theirs, their_opt)):
            optimizer.zero_grad(set_to_none=True)
            for i, ids in enumerate(micro):
                if i < len(micro) - 1:
                    with model.no_sync():
                        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                else:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        grads = largest((p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))
        for optimizer, schedule in ((our_opt, our_schedule), (their_opt, their_schedule)):
            optimizer.step()
            schedule.step()
        raw = None
        if len(steps) % 2:  # the parameters themselves, waited for by hand
            xpt.distributed.wait_for_parameters(our_opt)
            raw = largest(zip(ours.parameters(), theirs.parameters()))
        with torch.no_grad():  # a forward right after the step: it waits for the gathers
            logits = largest([(ours(input_ids=probe).logits, theirs(input_ids=probe).logits)])
        ours_state, theirs_state = ours.module.state_dict(), theirs.module.state_dict()
        params = largest((ours_state[k], theirs_state[k]) for k in theirs_state)
        steps.append({
            "sharded": our_opt._xpuruntime_shards.sharded, "grads": grads, "logits": logits,
            "params": params, "raw": raw,
            "state": [state_elements(our_opt), state_elements(their_opt)],
        })  # fmt: skip

    for i in range(6):
        step([batches[i]])
    step(batches[6:8])  # two micro-batches, the first under no_sync
    saved = compare_state_dicts(our_opt.state_dict(), their_opt.state_dict())
    saved_whole = copy.deepcopy(their_opt.state_dict())  # as from a checkpoint file
    our_opt.load_state_dict(saved_whole)  # a whole optimizer's, cut to the slices
    step([batches[8]])
    shards = our_opt._xpuruntime_shards
    gathers = shards._gathers.how + (", halved all-reduce" if shards._buckets.halves else "")
    embedding = ours.module.get_input_embeddings().weight  # tied: in DDP's first bucket
    whole = {  # the buckets the forward needs first: the embedding's among them
        "embedding": any(p is embedding for p in shards.whole_parameters),
        "count": len(shards.whole_parameters),
        "share": sum(p.numel() for p in shards.whole_parameters)
        / sum(p.numel() for p in ours.parameters() if p.requires_grad),
    }
    from xpuruntime.pytorch._selection._routed import ROUTED_OPS

    chosen = sorted({d.chosen for op in ("linear", "projections")
                     for d in ROUTED_OPS[op].decisions.values()})  # fmt: skip
    print(json.dumps({"rank": rank, "steps": steps, "gathers": gathers, "saved": saved,
                      "whole": whole, "chosen": chosen,
                      "refused": refusals(ours, device)}), flush=True)  # fmt: skip
    torch.distributed.barrier()  # out without gloo's teardown (see lora_ranks.py)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

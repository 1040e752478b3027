"""peft LoRA on a transformers Llama, optimized, then spread over the job's ranks (run by
tests/test_distributed.py under torchrun, or alone with --single): DDP,
``xpt.distributed.data_parallel`` (``data-parallel``: the adapters kept whole, their
gradients averaged without DDP), or FSDP2 over
each decoder layer and the model (the frozen base sharded with the adapters), or
``xpt.distributed.shard`` (the same units found by itself, computed in bf16; with
``shard-replicated`` in fp32, the adapters left out of FSDP2, whole on every rank). Each rank
trains on its shard of one global batch; prints the global batch's mean losses, and the
report's first line on rank 0. With ``--fp8-base`` the bases are stored in FP8 (on the
CPU: PyTorch's ``_scaled_mm``); ``--fp8-activations`` keeps gate and up in FP8 too.
``--qlora`` makes the decoder's linear layers bitsandbytes nf4 first (QLoRA's base; a
wider model, whose rows hold whole blocks), ``--qlora-fp8`` the same under
``precision="fp8"``: the 4-bit bases made FP8 on each call.
Sharded, rank 0 also says how many of its shards are stored weights and their rows, and
what its first attention's q_proj base was in each forward (gathered by FSDP2). Alone,
it says how many rows the stored weights have. ``--cuda`` runs on each rank's GPU over
NCCL; ``--graph`` there trains by ``make_train_step``'s graphed step. ``--accumulate N``
trains by ``make_train_step``, each rank's batch in N micro-batches.

    torchrun --nproc_per_node 2 tests/jobs/lora_ranks.py \
        ddp|data-parallel|fsdp2|shard|shard-replicated [--cuda [--graph]] [--accumulate N]
        [--fp8-base [--fp8-activations] | --qlora | --qlora-fp8]
    python tests/jobs/lora_ranks.py single [--world 2] [--cuda [--graph]]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import SMALL

from xpuruntime import pytorch as xpt

PER_RANK, STEPS = 2, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "how", choices=["ddp", "data-parallel", "fsdp2", "shard", "shard-replicated", "single"]
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--fp8-base", action="store_true",
                        help="the bases stored in FP8, the step under bf16 autocast")  # fmt: skip
    parser.add_argument("--fp8-activations", action="store_true",
                        help="with --fp8-base: the MLPs' gate and up kept in FP8 too")  # fmt: skip
    parser.add_argument("--qlora", action="store_true", help="the base in bitsandbytes nf4")
    parser.add_argument("--qlora-fp8", action="store_true", help="--qlora under FP8")
    parser.add_argument("--cuda", action="store_true", help="on the rank's GPU, over NCCL")
    parser.add_argument("--graph", action="store_true", help="with --cuda: graphed steps")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="make_train_step's accumulation_steps over each batch")  # fmt: skip
    args = parser.parse_args()
    rank, world = 0, args.world
    if args.how != "single":
        xpt.distributed.init_distributed("nccl" if args.cuda else "gloo")
        rank, world = xpt.distributed.rank(), xpt.distributed.world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.cuda else "cpu")
    torch.manual_seed(0)
    qlora = args.qlora or args.qlora_fp8
    wide = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16} if qlora else {}
    config = transformers.AutoConfig.for_model("llama", **{**SMALL, **wide})
    model = transformers.AutoModelForCausalLM.from_config(config)
    if qlora:
        model = _four_bit(model.to(torch.bfloat16))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    policy = None
    if args.fp8_base or args.qlora_fp8:
        from xpuruntime.pytorch._kernels import fp8

        fp8.fp8_refusal = lambda device: None  # PyTorch's _scaled_mm runs on the CPU
        policy = {"precision": "fp8", "fp8_base": args.fp8_base,
                  "fp8_activations": args.fp8_activations}  # fmt: skip
    if args.qlora_fp8:  # FP8 at this tiny model's shapes (the table's bounds are above)
        fp8.FP8_MIN_TOKENS, fp8.FP8_MIN_WEIGHT = 16, 0
    model.to(device)
    stepped = args.graph or args.accumulate > 1  # by make_train_step, which optimizes
    if not stepped:
        report = xpt.optimize(model, policy)
    if args.how == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.how == "data-parallel":  # (this tiny model's adapters are 14% of it: named)
        model = xpt.distributed.data_parallel(model, replicate_trained=True)
    elif args.how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__ == "LlamaDecoderLayer":
                fully_shard(module)
        fully_shard(model)
    elif args.how.startswith("shard"):
        replicated = args.how == "shard-replicated"  # (in fp32: compared exactly)
        xpt.distributed.shard(model, precision="fp32" if replicated else "bf16",
                              replicate_trained=replicated)  # fmt: skip
        layers = model.base_model.model.model.layers
        if not all(type(layer).__name__.startswith("FSDP") for layer in layers):
            raise SystemExit("shard: the decoder layers were not the units")
    gathered = []  # what a stored base's layer reads in the forward (FSDP2's gather)
    if args.fp8_base and args.how in ("fsdp2", "shard"):
        attention = model.get_submodule("base_model.model.model.layers.0.self_attn")
        attention.register_forward_pre_hook(
            lambda m, _: gathered.append(type(m.q_proj.base_layer.weight).__name__)
        )
    trained = [p for p in model.parameters() if p.requires_grad]
    if args.graph:  # a captured optimizer step keeps its state and lr on the device
        lr = torch.tensor(1e-2, device=device)
        optimizer = torch.optim.AdamW(trained, lr=lr, capturable=True, foreach=True)
    else:
        optimizer = torch.optim.AdamW(trained, lr=1e-2)
    shard = slice(None) if args.how == "single" else slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def batch(step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(100 + step)
        return torch.randint(3, 96, (PER_RANK * world, 16), generator=generator)[shard].to(device)

    if stepped:
        train_step, report = xpt.make_train_step(
            model, lambda output, _: output.loss, optimizer,
            {"input_ids": batch(0), "labels": batch(0)},
            {**(policy or {}), "cuda_graph": args.graph}, accumulation_steps=args.accumulate,
        )  # fmt: skip
    losses, grad_norm = [], None
    for step in range(STEPS):
        ids = batch(step)
        if stepped:
            loss = train_step({"input_ids": ids, "labels": ids})
        else:
            with torch.autocast("cpu", torch.bfloat16, enabled=args.fp8_base or qlora):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 0:  # the adapters' first gradients, whole (Adam hides their scale)
                first = [_whole(p.grad) for p in trained]
                grad_norm = float(torch.cat([g.float().flatten() for g in first]).norm())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if args.how != "single":
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    whole = [p for p in trained if not hasattr(p, "_local_tensor")]
    spread = None  # the largest difference of a whole adapter between the ranks
    if whole and args.how != "single":
        values = torch.cat([p.detach().float().flatten() for p in whole])
        gathered_values = [torch.empty_like(values) for _ in range(world)]
        torch.distributed.all_gather(gathered_values, values)
        spread = max(float((v - values).abs().max()) for v in gathered_values)
    if rank == 0:
        result = {"losses": losses, "report": str(report).splitlines()[0],
                  "whole": len(whole), "trained": len(trained), "spread": spread,
                  "grad_norm": grad_norm, "wrapped": type(model).__name__}  # fmt: skip
        if qlora:  # what each LoRA group's call ran
            from xpuruntime.pytorch._selection._routed import ROUTED_OPS

            decided = ROUTED_OPS["lora_linear"].decisions.values()
            result["chosen"] = sorted({d.chosen for d in decided})
        if args.fp8_base and args.how == "single":
            result["stored_rows"] = sum(p.shape[0] for p in model.parameters()
                                        if type(p).__name__ == "Fp8Weight")  # fmt: skip
        if gathered:  # each rank's shards of the stored bases, and what it gathered
            shards = [getattr(p, "_local_tensor", p) for p in model.parameters()]
            stored = [t for t in shards if type(t).__name__ == "Fp8Weight"]
            result["fp8_shards"] = len(stored)
            result["fp8_shard_rows"] = sum(t.shape[0] for t in stored)
            result["gathered"] = sorted(set(gathered))
        print(json.dumps(result), flush=True)
    if args.how != "single":
        # Every rank past its last collective, then out without tearing gloo down: a rank
        # once stayed idle for minutes after its result (twice: in the teardown, then in
        # destroy_process_group), on the 2-core CI machine under load.
        torch.distributed.barrier()


def _four_bit(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its decoder's linear layers made bitsandbytes nf4 ``Linear4bit``
    (bf16 compute), as ``load_in_4bit`` loads them, marked so for peft."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name.endswith("_proj"):
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, quant_type="nf4")  # fmt: skip
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data.float(), requires_grad=False, quant_type="nf4"
                )
                setattr(module, name, layer)
    model.is_loaded_in_4bit = True  # what peft reads to wrap the layers as QLoRA's
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where it is FSDP2's shard (a DTensor), all of it."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

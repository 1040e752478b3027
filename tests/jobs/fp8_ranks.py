"""A transformers Llama optimized under ``precision="fp8"`` (every linear layer's GEMMs
FP8: on the CPU PyTorch's ``_scaled_mm``, the device check and the size table set
aside), then sharded by ``xpt.distributed.shard`` (FSDP2, computed in bf16; the
trained weights of the FP8 GEMMs gathered in FP8) over the job's ranks (run by tests/test_distributed.py under torchrun, or alone with --single).
Each rank trains on its shard of one global batch under bf16 autocast; rank 0 prints the
global batch's mean losses and the kernels the linear layers chose.

    torchrun --nproc_per_node 2 tests/jobs/fp8_ranks.py shard
    python tests/jobs/fp8_ranks.py single
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
from xpuruntime.pytorch._kernels import fp8
from xpuruntime.pytorch._selection._routed import ROUTED_OPS

PER_RANK, WORLD, STEPS = 2, 2, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("how", choices=["shard", "single"])
    args = parser.parse_args()
    fp8.FP8_MIN_TOKENS = fp8.FP8_MIN_WEIGHT = 0
    fp8.fp8_refusal = lambda device: None
    rank = 0
    if args.how == "shard":
        xpt.distributed.init_distributed("gloo")
        rank = xpt.distributed.rank()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL)
    model = transformers.AutoModelForCausalLM.from_config(config)
    xpt.optimize(model, {"precision": "fp8"})
    if args.how == "shard":
        xpt.distributed.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = slice(None) if args.how == "single" else slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, 96, (PER_RANK * WORLD, 16), generator=generator)[rows]
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if args.how == "shard":
            torch.distributed.all_reduce(loss)
            loss /= WORLD
        losses.append(float(loss))
    chosen = sorted({d.chosen for op in ("linear", "projections")
                     for d in ROUTED_OPS[op].decisions.values()})  # fmt: skip
    gathered = sum(type(getattr(p, "_local_tensor", p)).__name__ == "Fp8Shard"
                   for p in model.parameters())  # fmt: skip
    if rank == 0:
        print(json.dumps({"losses": losses, "chosen": chosen, "gathered_in_fp8": gathered}),
              flush=True)  # fmt: skip
    if args.how == "shard":
        torch.distributed.barrier()  # out without gloo's teardown (see lora_ranks.py)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

"""Train a small GPT with DDP, one kernel policy on every rank, and the ranks' decisions
gathered on rank 0.

    torchrun --nproc_per_node 2 examples/train_ddp.py [--steps 20]    # CPUs (gloo) or GPUs (NCCL)
    python examples/train_ddp.py --single [--world 2]                 # the same global batch, one process

Each rank trains on its shard of the same global batch (8 sequences per rank), so the
losses equal those of one process that sees the whole batch (``--single``). The policy
is checked across ranks when it is set; rank 0 prints every rank's kernel decisions.
Pass ``--policy-from-rank`` to give rank 1 a different policy and see the job refuse it.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

import xpuruntime as xrt
from xpuruntime import pytorch as xpt

VOCAB, DIM, HEADS, CONTEXT, PER_RANK = 256, 64, 4, 32, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        y = xpt.ops.fused_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(CONTEXT, DIM)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        torch.nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(x)))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def global_batch(step: int, world: int) -> torch.Tensor:
    """The step's whole batch, the same in every process (seeded by the step). Tokens
    come from the first 32 of the vocabulary only, so the loss has somewhere to go (from
    ln 256 = 5.55 towards ln 32 = 3.47) within a few steps."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 32, (PER_RANK * world, CONTEXT + 1), generator=generator)


def policy_for(rank: int, differ: bool, strategy: str) -> xrt.KernelPolicy:
    policy = xrt.KernelPolicy(layernorm="auto", attention="auto", auto_strategy=strategy)
    if differ and rank == 1:
        policy.set("layernorm", "torch")
    return policy


def train(
    steps: int,
    rank: int,
    world: int,
    device: str,
    differ: bool = False,
    strategy: str = "first_supported",
    accumulate: int = 1,
    fsdp: bool = False,
    graph: bool = False,
    static_graph: bool = False,
    find_unused: bool = False,
) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    policy = policy_for(rank, differ, strategy)
    policy.cuda_graph = graph  # the whole step, all-reduce included, as one CUDA graph
    if world > 1 and xpt.distributed.is_initialized() and fsdp:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 swaps parameters into the modules it was given: the policy's module
        # replacements come first, then the sharding, then the optimizer.
        xpt.optimize(model, policy)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif world > 1 and xpt.distributed.is_initialized() and (graph or static_graph):
        # static_graph, gradients as the all-reduce's buckets, built on a side stream:
        # what a graphed step (the all-reduce captured) needs.
        model = xpt.distributed.data_parallel(model)
    elif world > 1 and xpt.distributed.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model,
            device_ids=[device] if device != "cpu" else None,
            find_unused_parameters=find_unused,  # walks the graph from the outputs
        )
    if graph:  # a captured optimizer step keeps its state and lr on the device
        lr = torch.tensor(1e-2, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard = (
        slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        if xpt.distributed.is_initialized()
        else slice(None)
    )
    tokens = global_batch(0, world)[shard].to(device)
    step, _ = xpt.make_train_step(
        model,
        loss_fn,
        opt,
        (tokens[:, :-1], tokens[:, 1:]),
        policy,
        accumulation_steps=accumulate,
    )
    losses = []
    for i in range(steps):
        tokens = global_batch(i, world)[shard].to(device)
        loss = step((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())).detach()
        if xpt.distributed.is_initialized():  # the global batch's mean loss
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--single", action="store_true", help="one process, whole batch")
    parser.add_argument("--world", type=int, default=2, help="with --single: ranks to mimic")
    parser.add_argument("--policy-from-rank", action="store_true", help="rank 1 differs")
    parser.add_argument(
        "--strategy", default="first_supported", choices=["first_supported", "best_performance"]
    )
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    parser.add_argument("--graph", action="store_true", help="graphed steps (CUDA, DDP)")
    parser.add_argument(
        "--static-graph", action="store_true", help="xpt.distributed.data_parallel (static graph)"
    )
    parser.add_argument("--find-unused", action="store_true", help="DDP find_unused_parameters")
    args = parser.parse_args()
    if args.single:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        losses = train(
            args.steps,
            0,
            args.world,
            device,
            strategy=args.strategy,
            accumulate=args.accumulate,
            graph=args.graph,
        )
        print(json.dumps({"losses": losses}))
        return
    xpt.distributed.init_distributed()
    rank, world = xpt.distributed.rank(), xpt.distributed.world_size()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    xpt.enable_dispatch_logging()
    try:
        losses = train(
            args.steps,
            rank,
            world,
            device,
            args.policy_from_rank,
            args.strategy,
            args.accumulate,
            args.fsdp,
            args.graph,
            args.static_graph,
            args.find_unused,
        )
    except xrt.PolicyError as e:
        print(json.dumps({"rank": rank, "policy_error": str(e)}), flush=True)
        # Every rank raised: each has said why, then the job ends with an error. Not by
        # tearing down the process group: torch's gloo group, freed with the DDP model
        # while a worker thread still drops its last collective, can deadlock (the
        # destructor joins that thread holding the GIL, which the thread waits for).
        torch.distributed.barrier()
        os._exit(1)
    records = xpt.distributed.gather_dispatch_logs()
    if rank == 0:
        chosen, measured = {}, {}
        for r in records:
            chosen.setdefault(r.rank, {}).setdefault(r.op, set()).add(r.chosen)
            if "measured on rank 0" in r.reason:
                measured[r.rank] = measured.get(r.rank, 0) + 1
        for r, ops in sorted(chosen.items()):
            print(
                f"rank {r}: "
                + ", ".join(f"{op}={'/'.join(sorted(k))}" for op, k in sorted(ops.items()))
            )
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps on {world} ranks")
        print(xpt.explain_kernel_policy().splitlines()[1:3])
        decisions = {r: {op: sorted(k) for op, k in ops.items()} for r, ops in chosen.items()}
        print(
            json.dumps(
                {
                    "losses": losses,
                    "decisions": decisions,
                    "ranks": sorted(chosen),
                    "taken_from_rank_0": measured,
                }
            )
        )
    assert all(math.isfinite(v) for v in losses)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

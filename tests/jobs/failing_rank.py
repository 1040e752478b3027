"""A DDP job in which one rank fails in the middle of its steps (run by
tests/test_distributed.py under torchrun): the job must end with that rank's error, not
hang in the others' next collective. Where it fails: between steps, inside the forward,
inside the backward (a gradient hook), or by running out of CUDA memory in the forward
(an allocation the GPU cannot hold). With ``replicated`` the trained parameters are kept
whole on every rank without DDP (``data_parallel(model, replicate_trained=True)``).

    torchrun --nproc_per_node 2 tests/jobs/failing_rank.py FAILING_RANK STEP [gloo|nccl]
        [between|forward|backward|oom] [ddp|replicated]
"""

import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from xpuruntime import pytorch as xpt


@record  # the failing rank's traceback goes to torchrun's summary of the job
def main() -> None:
    failing_rank, failing_step = int(sys.argv[1]), int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else None
    where = sys.argv[4] if len(sys.argv) > 4 else "between"
    replicated = len(sys.argv) > 5 and sys.argv[5] == "replicated"
    xpt.distributed.init_distributed(backend, timeout=600)  # far longer than the test waits
    rank = xpt.distributed.rank()
    device = f"cuda:{torch.cuda.current_device()}" if backend != "gloo" else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    now = {"step": 0}
    failing = rank == failing_rank

    def fail(*args):
        if failing and now["step"] == failing_step:
            if where == "oom":  # more than any GPU holds
                torch.empty(2**50, dtype=torch.uint8, device=device)
            raise RuntimeError(f"rank {rank} failed in step {now['step']}, as the test asked")

    if where in ("forward", "oom"):
        model[2].register_forward_pre_hook(lambda module, args: fail())
    elif where == "backward":
        model[0].weight.register_hook(lambda grad: fail())
    if replicated:
        model = xpt.distributed.data_parallel(model.to(device), replicate_trained=True)
    else:
        model = DistributedDataParallel(model.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device))
    step, _ = xpt.make_train_step(model, torch.nn.functional.cross_entropy, optimizer, batch)
    for i in range(6):
        now["step"] = i
        if where == "between":
            fail()
        step(batch)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()

"""A DDP job in which one rank raises in the middle of its steps (run by
tests/test_distributed.py under torchrun): the job must end with that rank's error, not
hang in the others' next collective.

    torchrun --nproc_per_node 2 tests/jobs/failing_rank.py FAILING_RANK STEP [gloo|nccl]
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
    xpt.distributed.init_distributed(backend, timeout=600)  # far longer than the test waits
    rank = xpt.distributed.rank()
    device = f"cuda:{torch.cuda.current_device()}" if backend != "gloo" else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(model.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device))
    step, _ = xpt.make_train_step(model, torch.nn.functional.cross_entropy, optimizer, batch)
    for i in range(6):
        if rank == failing_rank and i == failing_step:
            raise RuntimeError(f"rank {rank} failed in step {i}, as the test asked")
        step(batch)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()

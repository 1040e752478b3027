"""The ops of a block of code that read a value back to the host: what a CUDA graph
cannot hold, counted on any device."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


@contextlib.contextmanager
def host_reads():
    """Inside, every op that read a value back to the host, in order."""
    reads: list = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _READS:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        yield reads

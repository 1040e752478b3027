"""The tensors the ops of a block of code make (its views left out): what a test counts
to say a copy, a cast or a buffer was or was not made."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@contextlib.contextmanager
def tensors_made():
    """Inside, every tensor an op returns that is not a view of its inputs, in order
    (held: one object per tensor made; an op writing into ``out=`` returns it again)."""
    made: list[torch.Tensor] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                made.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Record():
        yield made

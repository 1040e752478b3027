"""What autograd keeps for a backward: the bytes a fused op saves, compared with what the
layers as written save."""

import torch


def kept_for_backward(run, parameters) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``run()``, the
    parameters' own storage not counted (a kept parameter is a reference)."""
    own = {p.untyped_storage().data_ptr() for p in parameters}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())

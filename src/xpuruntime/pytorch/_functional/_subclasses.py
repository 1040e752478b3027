"""What our tensor subclasses that stand for values not yet made (deferred logits, a
packed batch's documents) answer without making them."""

from torch import Tensor

__all__ = ["METADATA"]

METADATA = {
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.__len__,
    Tensor.is_floating_point,
    Tensor.shape.__get__,
    Tensor.dtype.__get__,
    Tensor.device.__get__,
    Tensor.ndim.__get__,
    Tensor.is_cuda.__get__,
    Tensor.requires_grad.__get__,
    Tensor.grad_fn.__get__,
    Tensor.is_leaf.__get__,
    Tensor._base.__get__,
    Tensor.grad.__get__,
    # Its layout, as torch.compile's fake tensors copy it: answered from the placeholder
    # (strides 0 over one element), as the C++ side sees it. Answered from the values
    # made, they disagreed with it, and a compiled frame taking the logits as an input
    # (DDP's output hooks on a static graph's first step) failed its own guard.
    Tensor.stride,
    Tensor.storage_offset,
    Tensor.untyped_storage,
    Tensor._is_view,
    Tensor.is_inference,
    Tensor.is_conj,
    Tensor.is_neg,
    Tensor.layout.__get__,
    Tensor.is_sparse.__get__,
    Tensor.is_quantized.__get__,
    Tensor.is_nested.__get__,
    Tensor.is_mkldnn.__get__,
}
"""The functions that read a tensor's metadata (shape, dtype, device, layout, autograd
flags), never its values."""

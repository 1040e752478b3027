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
}
"""The functions that read a tensor's metadata (shape, dtype, device, autograd flags),
never its values."""

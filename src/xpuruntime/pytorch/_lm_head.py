"""A language-model head whose logits are computed by their loss, when the loss is
``F.cross_entropy``: what :func:`optimize` puts in place of a model's ``lm_head``.

The head returns :class:`DeferredLogits`, a tensor with the logits' shape, dtype and
device but no storage, that remembers the hidden states and the weight. When
``F.cross_entropy`` receives it (after any ``view``/``reshape``/``flatten`` that keeps
the vocabulary dimension), the policy's ``cross_entropy`` op decides: ``fused_linear``
runs :func:`ops.fused_linear_cross_entropy`, which never materialises the logits;
``torch`` materialises them and calls PyTorch. Any other use of the logits (sampling,
metrics, ``softmax``) materialises them first and runs as the model wrote it, so the
model's meaning never changes; the first such use warns once, because it costs the
memory the fusion saves.

Interception happens in Python (``__torch_function__``) on the head's output only: a
few microseconds per step, nothing inside a captured CUDA graph.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._context import LossContext
from ._routed import RoutedOp
from .ops._launch import autocast_dtype

__all__ = ["DeferredLogits", "LinearCrossEntropyHead"]

# Queries answered from the logits' metadata, without computing them.
_METADATA = {
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
}
_RESHAPES = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten}
_warned: set[str] = set()


class DeferredLogits(Tensor):
    """Logits not computed yet: ``hidden @ weight.T + bias``, in ``dtype``."""

    @staticmethod
    def __new__(cls, hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype):
        shape = (*hidden.shape[:-1], weight.shape[0])
        empty = torch.empty((), device=hidden.device, dtype=dtype).expand(shape)
        logits = Tensor._make_subclass(cls, empty, False)
        logits._hidden, logits._weight, logits._bias, logits._dtype = hidden, weight, bias, dtype
        return logits

    def __init__(self, *args, **kwargs) -> None:
        pass

    def materialize(self) -> Tensor:
        """The logits, computed as the original head would."""
        with torch.autocast(self._hidden.device.type, enabled=False):
            bias = None if self._bias is None else self._bias.to(self._dtype)
            return F.linear(self._hidden.to(self._dtype), self._weight.to(self._dtype), bias)

    def __repr__(self) -> str:
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _RESHAPES and isinstance(args[0], DeferredLogits):
            reshaped = _reshaped(func, args, kwargs)
            if reshaped is not None:
                return reshaped
        if func is F.cross_entropy:
            loss = _cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss  # else the policy chose PyTorch's loss, and said why
        else:
            _warn_once(
                getattr(func, "__name__", str(func)),
                "the logits of an optimized lm_head were used by {} before the loss, so "
                "they were materialised (the fused loss saves their memory only when "
                "F.cross_entropy is their one consumer)",
            )
        args, kwargs = _materialized(args), _materialized(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _materialized(tree):
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(DeferredLogits, DeferredLogits.materialize, tree)


def _reshaped(func, args, kwargs) -> DeferredLogits | None:
    logits: DeferredLogits = args[0]
    meta = torch.empty(logits.shape, device="meta")
    shape = func(meta, *args[1:], **kwargs).shape
    vocab = logits.shape[-1]
    if len(shape) == 0 or shape[-1] != vocab:
        return None
    hidden = logits._hidden.reshape(*shape[:-1], logits._hidden.shape[-1])
    return DeferredLogits(hidden, logits._weight, logits._bias, logits._dtype)


def _cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean", label_smoothing=0.0,
):  # fmt: skip
    """The loss through the policy's ``cross_entropy`` kernel; None to fall back to the
    materialised logits."""
    if not isinstance(input, DeferredLogits) or isinstance(target, DeferredLogits):
        return None
    unsupported = tuple(
        what
        for what, present in (
            ("class weights", weight is not None),
            ("label smoothing", label_smoothing != 0.0),
            ("size_average/reduce (deprecated)", size_average is not None or reduce is not None),
            ("probability targets", target.is_floating_point()),
            ("logits not flattened to (rows, classes)", input.dim() != 2 or target.dim() != 1),
        )
        if present
    )
    return _routed(input, target, ignore_index, reduction, unsupported)


def _signature(logits, target, ignore_index, reduction, unsupported) -> tuple:
    hidden = logits._hidden
    return (tuple(hidden.shape), logits.dtype, hidden.device, reduction, unsupported,
            torch.is_grad_enabled())  # fmt: skip


def _context(logits, target, ignore_index, reduction, unsupported) -> LossContext:
    return LossContext(logits._hidden, logits.shape[-1], logits.dtype, reduction, unsupported)


def _sample(ctx: LossContext, *call) -> tuple[tuple, list[Tensor]]:
    """A head and targets shaped as the call's, as the logits the loss would see."""
    rows, width = ctx.rows, ctx.hidden.shape[-1]
    x = torch.randn(rows, width, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    w = torch.randn(ctx.vocab, width, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    t = torch.randint(0, ctx.vocab, (rows,), device=ctx.device)
    return (_TimedLogits(x, w, None, ctx.dtype), t, -100, ctx.reduction, ()), [x, w]


class _TimedLogits:
    """Deferred logits for a timing run: the torch kernel materialises them."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype) -> None:
        self._hidden, self._weight, self._bias, self.dtype = hidden, weight, bias, dtype

    def materialize(self) -> Tensor:
        return F.linear(self._hidden, self._weight).float()


_routed = RoutedOp(
    "cross_entropy",
    signature=_signature,
    context=_context,
    sample=_sample,
    traced_auto=lambda device: "torch",
)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message.format(key), stacklevel=4)


class LinearCrossEntropyHead(nn.Module):
    """An ``nn.Linear`` LM head (sharing its parameters) that returns
    :class:`DeferredLogits`.

    Parameters
    ----------
    linear : nn.Linear
        The original head; its ``weight`` (tied or not) and ``bias`` are shared, so
        ``state_dict`` keys and optimizer state are unchanged.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: Tensor) -> Tensor:
        dtype = autocast_dtype(hidden.device.type) or torch.result_type(hidden, self.weight)
        return DeferredLogits(hidden, self.weight, self.bias, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, logits computed by the loss"
        )

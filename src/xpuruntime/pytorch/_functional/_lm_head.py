"""A language-model head whose logits are computed by their loss, when the loss is
``F.cross_entropy``: what :func:`optimize` puts in place of a model's ``lm_head``.

The head returns :class:`DeferredLogits`, a tensor with the logits' shape, dtype and
device but no storage, that remembers the hidden states and the weight. When
``F.cross_entropy`` receives it (after any ``view``/``reshape``/``flatten`` that keeps
the vocabulary dimension, a cast to another float dtype such as Hugging Face's
``logits.float()``, ``contiguous()``, indexing of the leading dimensions such as
``logits[:, :-1]``, and the transforms models apply before their loss: a multiplication
or division by a number, as Granite's ``/ logits_scaling`` and Cohere's
``* logit_scale``, and one ``tanh``, as Gemma 2's soft cap ``c * tanh(z / c)``: each
gives deferred logits again, whose GEMM keeps the head's compute dtype), the policy's
``cross_entropy`` op decides: ``fused_linear``
runs :func:`ops.fused_linear_cross_entropy`, which never materialises the logits (it
applies the transform to each logit in fp32);
``torch`` materialises them and calls PyTorch. Any other use of the logits (sampling,
metrics, ``softmax``) materialises them first, replaying the casts and transforms in
the order and dtypes the model applied them, and runs as the model wrote it, so the
model's meaning never changes; the first such use warns once, because it costs the
memory the fusion saves.

Interception happens in Python (``__torch_function__``) on the head's output only: a
few microseconds per step, nothing inside a captured CUDA graph.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..._errors import InvalidInputError
from .._kernels._context import LossContext
from .._ops._infra._launch import autocast_dtype
from .._selection._policy import torch_under_compile
from .._selection._routed import RoutedOp
from ._subclasses import METADATA

__all__ = ["DeferredLogits", "LinearCrossEntropyHead"]

# Queries answered from the logits' metadata, without computing them.
_RESHAPES = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten}
_CASTS = {Tensor.float, Tensor.to, Tensor.type_as}
# Elementwise transforms by a number, as (logits, number): the step they record.
_SCALINGS = {
    Tensor.__mul__: "mul", Tensor.__rmul__: "mul", Tensor.mul: "mul", torch.mul: "mul",
    Tensor.__truediv__: "div", Tensor.div: "div", torch.div: "div",
}  # fmt: skip
_TANHS = {torch.tanh, Tensor.tanh}
_warned: set[str] = set()


class DeferredLogits(Tensor):
    """Logits not computed yet: ``hidden @ weight.T + bias`` computed in
    ``compute_dtype``, then ``steps`` applied in order: ``("cast", dtype)``,
    ``("mul", number)``, ``("div", number)``, ``("tanh", None)``; ``dtype`` is the
    result's."""

    @staticmethod
    def __new__(
        cls,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
        compute_dtype: torch.dtype | None = None,
        steps: tuple = (),
    ):
        shape = (*hidden.shape[:-1], weight.shape[0])
        empty = torch.empty((), device=hidden.device, dtype=dtype).expand(shape)
        logits = Tensor._make_subclass(cls, empty, False)
        logits._hidden, logits._weight, logits._bias, logits._dtype = hidden, weight, bias, dtype
        logits._compute = compute_dtype or dtype
        logits._steps = steps
        return logits

    def __init__(self, *args, **kwargs) -> None:
        pass

    def materialize(self) -> Tensor:
        """The logits, computed as the original head would, then cast and transformed
        as the caller did."""
        compute, hidden = self._compute, _through(self._hidden, self)
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self._bias is None else self._bias.to(compute)
            logits = F.linear(hidden.to(compute), self._weight.to(compute), bias)
            for step, value in self._steps:
                if step == "cast":
                    logits = logits.to(value)
                elif step == "mul":
                    logits = logits * value
                elif step == "div":
                    logits = logits / value
                else:
                    logits = torch.tanh(logits)
        return logits.to(self._dtype)

    @property
    def transform(self) -> tuple[float, float | None] | None:
        """The steps as ``(scale, softcap)``: each logit ``z`` taken as ``z * scale``,
        then ``softcap * tanh(z / softcap)``; None where they are not of that form (two
        tanh). Casts are left out: the fused loss computes in fp32."""
        pre, post, capped = 1.0, 1.0, False
        for step, value in self._steps:
            if step == "tanh":
                if capped:
                    return None
                capped = True
            elif step in ("mul", "div"):
                factor = value if step == "mul" else 1.0 / value
                if capped:
                    post *= factor
                else:
                    pre *= factor
        if not capped:
            return pre, None
        # post * tanh(pre * z) = c * tanh(s * z / c) with c = |post|, s = pre * post
        return pre * post, abs(post)

    def _like(self, hidden: Tensor, step: tuple | None = None) -> DeferredLogits:
        """Deferred logits of ``hidden`` (rows of this one's), with ``step`` added."""
        steps = self._steps if step is None else (*self._steps, step)
        dtype = step[1] if step is not None and step[0] == "cast" else self._dtype
        return deferred_logits(
            (self,), hidden, self._weight, self._bias, dtype, self._compute, steps
        )

    def __repr__(self) -> str:
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA or func is Tensor.register_hook:
            # A hook acts on the autograd history, not the values: FSDP2 hooks a model's
            # outputs to start its backward. The logits' gradient is never formed (the
            # loss's reaches the hidden states): such a hook is called with None.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if args and isinstance(args[0], DeferredLogits):
            kept = _kept_deferred(func, args, kwargs)
            if kept is not None:
                return kept
        if func is F.cross_entropy:
            loss = _cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss  # else the policy chose PyTorch's loss, and said why
        elif _loss_could_fuse(args):
            _warn_once(
                getattr(func, "__name__", str(func)),
                "the logits of an optimized lm_head were used by {} before the loss, so "
                "they were materialised (the fused loss saves their memory only when "
                "F.cross_entropy is their one consumer)",
            )
        args, kwargs = _materialized(args), _materialized(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def deferred_logits(
    parents: tuple, hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None, steps: tuple = (),
) -> DeferredLogits:  # fmt: skip
    """:class:`DeferredLogits` whose autograd history leads to ``parents`` (the head's
    input and parameters, or the deferred logits they were derived from).

    No gradient flows along that history: the loss, or the materialised logits, reach
    the hidden states and the weight directly, and :func:`_through` sends their backward
    through the deferred logits as well. What held the logits on the way (a
    ``DistributedDataParallel`` output sink, whose backward starts the gradients'
    all-reduce on a static graph's first step) thus runs its backward, and a walk of
    the graph from the model's outputs (``find_unused_parameters``) finds every
    parameter the logits depend on."""

    def make() -> DeferredLogits:
        return DeferredLogits(hidden, weight, bias, dtype, compute_dtype, steps)

    linked = tuple(p for p in parents if p is not None)
    graphed = torch.is_grad_enabled() and any(p.requires_grad for p in linked)
    logits = _Linked.apply(make, *linked) if graphed else make()
    # From a forward with gradients, itself or the logits it was derived from: there a
    # loss could have been fused (what the materialising warning is about).
    logits._from_training = graphed or any(getattr(p, "_from_training", False) for p in linked)
    return logits


class _Linked(torch.autograd.Function):
    """``make()``, with ``parents`` as its autograd inputs; its backward passes nothing on."""

    @staticmethod
    def forward(ctx, make, *parents):
        ctx.inputs = 1 + len(parents)
        # No gradient reaches the deferred logits (:func:`_through` passes None): left
        # unmaterialised, autograd would fill a logits-sized tensor of zeros for it.
        ctx.set_materialize_grads(False)
        return make()

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * ctx.inputs


class _Through(torch.autograd.Function):
    """A copy of ``value`` (the loss, or the hidden states the logits are materialised
    from: small either way), whose backward also runs through ``logits``' history (with
    no gradient: :func:`deferred_logits`)."""

    @staticmethod
    def forward(ctx, value, logits):
        ctx.set_materialize_grads(False)
        return value.clone()

    @staticmethod
    def backward(ctx, grad, *_):
        return grad, None


def _through(value: Tensor, logits: DeferredLogits) -> Tensor:
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Through.apply(value, logits)
    return value


def _materialized(tree):
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(DeferredLogits, DeferredLogits.materialize, tree)


def _kept_deferred(func, args, kwargs) -> DeferredLogits | None:
    """What ``func(logits, ...)`` gives as deferred logits, or None where it needs the
    logits' values."""
    logits: DeferredLogits = args[0]
    if func in _RESHAPES:
        return _reshaped(func, args, kwargs)
    if func in _CASTS:
        dtype = _cast_dtype(func, args, kwargs)
        return None if dtype is None else logits._like(logits._hidden, ("cast", dtype))
    if func in _SCALINGS and len(args) == 2 and not kwargs and _plain_number(args[1]):
        return logits._like(logits._hidden, (_SCALINGS[func], float(args[1])))
    if func in _TANHS and len(args) == 1 and not kwargs:
        return logits._like(logits._hidden, ("tanh", None))
    if func is Tensor.contiguous and len(args) == 1 and not kwargs:
        return logits  # contiguous whenever it is computed
    if func in (Tensor.clone, torch.clone) and len(args) == 1 and not kwargs:
        # Computed afresh from the recipe: a copy that shares nothing to write over
        # (DistributedDataParallel clones a model's outputs on its first static-graph
        # step and under find_unused_parameters).
        return logits._like(logits._hidden)
    if func is Tensor.__getitem__ and not kwargs:
        return _indexed(logits, args[1])
    return None


def _plain_number(value) -> bool:
    """A finite, non-zero Python number (a tensor scalar would be read from the device)."""
    if value.__class__ not in (int, float):
        return False
    return math.isfinite(value) and value != 0


def _reshaped(func, args, kwargs) -> DeferredLogits | None:
    logits: DeferredLogits = args[0]
    meta = torch.empty(logits.shape, device="meta")
    shape = func(meta, *args[1:], **kwargs).shape
    vocab = logits.shape[-1]
    if len(shape) == 0 or shape[-1] != vocab:
        return None
    return logits._like(logits._hidden.reshape(*shape[:-1], logits._hidden.shape[-1]))


def _cast_dtype(func, args, kwargs) -> torch.dtype | None:
    """The float dtype a cast of the logits asks for, when it asks for nothing else (no
    device, copy or memory format); else None."""
    if func is Tensor.float:
        return torch.float32 if len(args) == 1 and not kwargs else None
    if func is Tensor.type_as:
        other = args[1] if len(args) == 2 and not kwargs else None
        dtype = other.dtype if isinstance(other, Tensor) else None
        same_device = isinstance(other, Tensor) and other.device == args[0].device
        return dtype if same_device and dtype.is_floating_point else None
    if len(args) == 2 and not kwargs and isinstance(args[1], torch.dtype):
        dtype = args[1]
    elif len(args) == 1 and set(kwargs) == {"dtype"}:
        dtype = kwargs["dtype"]
    else:
        return None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _indexed(logits: DeferredLogits, key) -> DeferredLogits | None:
    """``logits[key]`` deferred, for a key of ints and slices that leaves the vocabulary
    dimension whole (``logits[:, :-1]``, ``logits[..., 1:, :]``); else None."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is not Ellipsis and not isinstance(k, (int, slice)) for k in key):
        return None  # None (new axes), tensors, masks: the logits' values are needed
    if key.count(Ellipsis) > 1:
        return None
    if Ellipsis in key:  # spelled out, so that the last entry is the vocabulary's
        position = key.index(Ellipsis)
        fill = (slice(None),) * (logits.dim() - len(key) + 1)
        key = key[:position] + fill + key[position + 1 :]
    if len(key) > logits.dim() or (len(key) == logits.dim() and key[-1] != slice(None)):
        return None
    return logits._like(logits._hidden[key])


def _cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean", label_smoothing=0.0,
):  # fmt: skip
    """The loss through the policy's ``cross_entropy`` kernel; None to fall back to the
    materialised logits."""
    if not isinstance(input, DeferredLogits) or isinstance(target, DeferredLogits):
        return None
    if input.dim() == 2 and target.dim() == 1 and target.shape[0] != input.shape[0]:
        raise InvalidInputError(  # (what F.cross_entropy refuses, a ValueError, named)
            f"cross_entropy: the logits have {input.shape[0]} rows and the target "
            f"{target.shape[0]}; expected one target per row (labels shaped as input_ids)"
        )
    unsupported = tuple(
        what
        for what, present in (
            ("logits transformed otherwise than a scale and one tanh", input.transform is None),
            ("class weights", weight is not None),
            ("label smoothing", label_smoothing != 0.0),
            ("size_average/reduce (deprecated)", size_average is not None or reduce is not None),
            ("probability targets", target.is_floating_point()),
            ("logits not flattened to (rows, classes)", input.dim() != 2 or target.dim() != 1),
        )
        if present
    )
    loss = _routed(input, target, ignore_index, reduction, unsupported)
    return None if loss is None else _through(loss, input)


def _signature(logits, target, ignore_index, reduction, unsupported) -> tuple:
    hidden = logits._hidden
    return (tuple(hidden.shape), logits.dtype, logits._compute, hidden.device, reduction,
            unsupported, logits.transform, torch.is_grad_enabled())  # fmt: skip


def _context(logits, target, ignore_index, reduction, unsupported) -> LossContext:
    return LossContext(
        logits._hidden, logits.shape[-1], logits._compute, reduction, unsupported,
        logits.transform or (1.0, None),
    )  # fmt: skip


def _sample(ctx: LossContext, *call) -> tuple[tuple, list[Tensor]]:
    """A head and targets shaped as the call's, as the logits the loss would see."""
    rows, width = ctx.rows, ctx.hidden.shape[-1]
    x = torch.randn(rows, width, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    w = torch.randn(ctx.vocab, width, device=ctx.device, dtype=ctx.dtype, requires_grad=True)
    t = torch.randint(0, ctx.vocab, (rows,), device=ctx.device)
    logits = _TimedLogits(x, w, None, ctx.dtype, ctx.transform)
    return (logits, t, -100, ctx.reduction, ()), [x, w]


class _TimedLogits:
    """Deferred logits for a timing run: the torch kernel materialises them."""

    def __init__(self, hidden, weight, bias, dtype, transform) -> None:
        self._hidden, self._weight, self._bias, self.dtype = hidden, weight, bias, dtype
        self._compute = dtype  # what the kernels read as DeferredLogits' compute dtype
        self.transform = transform

    def materialize(self) -> Tensor:
        scale, softcap = self.transform
        logits = F.linear(self._hidden, self._weight).float() * scale
        return logits if softcap is None else softcap * torch.tanh(logits / softcap)


_routed = RoutedOp(
    "cross_entropy",
    signature=_signature,
    context=_context,
    sample=_sample,
    traced_auto=torch_under_compile,
)


def _loss_could_fuse(args: tuple) -> bool:
    """Whether the deferred logits among ``args`` came from a forward with gradients (a
    training one, where a fused loss saves their memory); an inference forward's logits
    are read as they are, without a word."""
    return any(isinstance(a, DeferredLogits) and a._from_training for a in args)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message.format(key), stacklevel=4)


class LinearCrossEntropyHead(nn.Module):
    """An ``nn.Linear`` LM head (sharing its parameters) that returns
    :class:`DeferredLogits` (inside a ``torch.compile`` trace: the logits, since a
    compiled graph cannot defer them; torch.compile then fuses the loss its own way. A
    model's forward split at its head by ``optimize`` calls it outside the trace, except
    under ``fullgraph=True``).

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
        if torch.compiler.is_compiling():
            # A compiled graph cannot carry logits that are not computed yet (dynamo
            # fails on the subclass at the model's own `logits.float()`): the head
            # computes them, and torch.compile fuses the loss its own way.
            return F.linear(hidden, self.weight, self.bias)
        dtype = autocast_dtype(hidden.device.type) or torch.result_type(hidden, self.weight)
        return deferred_logits(
            (hidden, self.weight, self.bias), hidden, self.weight, self.bias, dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, logits computed by the loss"
        )

r"""fused_add_layernorm: a residual add and the layer norm of its sum, in one kernel.

.. math::
    h = x + y,\qquad n = \mathrm{LayerNorm}(h)

as in a pre-norm transformer block (``x = x + attn(ln_1(x)); n = ln_2(x)``), where the
sum is both the next residual and the norm's input. Unfused, the add writes ``h`` and
the norm reads it back; in the backward the gradient reaching ``h`` from the norm and
from the residual's other user are summed by autograd (a kernel), and the add's
backward casts that sum to ``y``'s dtype (another kernel, for a bf16 branch added to an
fp32 residual under autocast). Here the forward reads ``x`` and ``y`` once and writes
``h`` and ``n``; the backward reads ``∂n``, ``h`` and ``∂h`` once and writes ``∂x`` and
``∂y`` in their own dtypes.

``h`` has the dtype PyTorch's add gives (the promotion of ``x`` and ``y``), computed in
fp32 and rounded once, as PyTorch computes it; the norm then reads the rounded ``h``, so
both outputs equal ``x + y`` followed by :func:`fused_layernorm`. The kernels are
fused_layernorm's own, in their residual variants. Rows wider than
:data:`MAX_ROW_BLOCK` take that unfused composition.
"""

import math

import torch
from torch import Tensor

from ._infra._launch import MAX_ROW_BLOCK, cast
from ._infra._native import PlanTable, Replay, replayed_call
from ._infra._op import kernel_op
from ._infra._rows import (
    check_residual_args,
    param_row,
    params_grad_dtype,
    residual_grads,
    trained_dtypes,
)
from .fused_layernorm import (
    fused_layernorm,
    layernorm_backward,
    layernorm_forward,
)

__all__ = ["fused_add_layernorm", "replay_add_layernorm", "run_add_layernorm"]


# -- launchers (dense (M, N) rows, N <= MAX_ROW_BLOCK): the layer-norm kernels' residual
# variants ------------------------------------------------------------------------------------
def _forward(
    x: Tensor, y: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    normed = torch.empty_like(x, dtype=out_dtype)
    mean = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    layernorm_forward(x, weight, bias, eps, normed, mean, rstd, residual=y, total=h)
    return h, normed, mean, rstd


def _forward_alone(x, y, weight, bias, eps, out_dtype) -> tuple[Tensor, Tensor]:
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    normed = torch.empty_like(x, dtype=out_dtype)
    layernorm_forward(x, weight, bias, eps, normed, None, None, residual=y, total=h)
    return h, normed


def _forward_fake(x, y, weight, bias, eps, out_dtype):
    stats = x.new_empty(x.shape[0], dtype=torch.float32)
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    return h, torch.empty_like(x, dtype=out_dtype), stats, torch.empty_like(stats)


def _backward(
    dn: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, mean: Tensor,
    rstd: Tensor, bias_grad: bool, x_dtype: torch.dtype, y_dtype: torch.dtype,
    grad_dtype: torch.dtype, weight_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(∂x, ∂y, ∂weight, ∂bias); ∂y is ∂x itself when the dtypes match, and the parameter
    gradients are summed in fp32 and written in ``grad_dtype`` (empty where not wanted:
    ``weight_grad``, ``bias_grad``, a parameter that trains)."""
    dx = torch.empty_like(h, dtype=x_dtype)
    dy = None if y_dtype == x_dtype else torch.empty_like(h, dtype=y_dtype)
    dw, db = layernorm_backward(
        dn, h, weight, mean, rstd, dx, bias_grad, dres=dh, dx2=dy, grad_dtype=grad_dtype,
        weight_grad=weight_grad,
    )  # fmt: skip
    if dw is None:
        dw = h.new_empty(0, dtype=grad_dtype)
    if db is None:
        db = h.new_empty(0, dtype=grad_dtype)
    return dx, dx if dy is None else dy, dw, db


def _backward_fake(
    dn, dh, h, weight, mean, rstd, bias_grad, x_dtype, y_dtype, grad_dtype, weight_grad
):
    n = h.shape[1]
    return (
        torch.empty_like(h, dtype=x_dtype),
        torch.empty_like(h, dtype=y_dtype),
        h.new_empty(n if weight is not None and weight_grad else 0, dtype=grad_dtype),
        h.new_empty(n if bias_grad else 0, dtype=grad_dtype),
    )


def _save(inputs, outputs):
    x, y, weight, bias = inputs[:4]
    h, _, mean, rstd = outputs
    params = trained_dtypes(weight, bias)
    state = ((x.dtype, y.dtype), params, params_grad_dtype(*params))
    return (h, weight, mean, rstd), state


def _prepare(saved, state, dh, dn):
    """The backward's arguments from the gradients of ``h`` and ``n`` (either may be
    None: an output nothing used)."""
    h, weight, mean, rstd = saved
    dn, dh = residual_grads(h, dh, dn)
    (w_dtype, b_dtype), grad_dtype = state[1:]
    return (dn, dh, h, weight, mean, rstd, b_dtype is not None, *state[0], grad_dtype,
            w_dtype is not None)  # fmt: skip


def _finish(state, grads):
    dx, dy, dw, db = grads
    w_dtype, b_dtype = state[1]
    return (
        dx,
        dy,
        None if w_dtype is None else cast(dw, w_dtype),
        None if b_dtype is None else cast(db, b_dtype),
        None,
        None,
    )


_add_layer_norm = kernel_op(
    "add_layer_norm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    prepare=_prepare,
    finish=_finish,
    outputs=2,
    alone=_forward_alone,
)


# -- the public entry ------------------------------------------------------------------------
def fused_add_layernorm(
    x: Tensor,
    y: Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``h = x + y`` and ``layer_norm(h)``, in one Triton kernel each way.

    Parameters
    ----------
    x, y : Tensor (..., *normalized_shape)
        The same shape (no broadcasting); fp32, fp16 or bf16, dtypes may differ (the sum
        takes PyTorch's promotion, e.g. fp32 for an fp32 residual plus a bf16 branch).
    normalized_shape : int or sequence of int
        The trailing dims normalised over.
    weight, bias : Tensor of shape ``normalized_shape``, optional
        The norm's affine parameters (gradients come back in their dtype).
    eps : float
        Added to the variance.
    out_dtype : torch.dtype, optional
        The normalised output's dtype (default: the sum's).

    Returns
    -------
    (Tensor, Tensor)
        The sum, in the promoted dtype, and its layer norm, in ``out_dtype``; both in
        ``x``'s shape. Gradients flow into ``x`` and ``y`` in their own dtypes.

    Raises
    ------
    InvalidInputError
        Shapes, dtypes or parameters that do not match (the message says which).
    UnsupportedOperationError, BackendUnavailableError
        The tensors are not on a device Triton runs on, or Triton is missing.

    Examples
    --------
    >>> x, normed = fused_add_layernorm(x, attn_out, 768, ln.weight, ln.bias)  # doctest: +SKIP
    """
    planned = replayed_call(_public_plans, x, y, normalized_shape, eps, out_dtype, weight, bias)
    if planned is not None:  # a call of a key checked before, run by its plan
        return planned
    params = (("weight", weight), ("bias", bias))
    shape, out_dtype = check_residual_args(
        "fused_add_layernorm", x, y, normalized_shape, params, out_dtype
    )
    n = math.prod(shape)
    if n > MAX_ROW_BLOCK:
        h = x + y
        return h, fused_layernorm(h, shape, weight, bias, eps, out_dtype=out_dtype)
    planned = replayed_call(
        _public_plans, x, y, shape, eps, out_dtype, weight, bias, checked=True
    )  # a key's second call derives its plan
    if planned is not None:
        return planned
    return run_add_layernorm(x, y, n, weight, bias, float(eps), out_dtype)


def run_add_layernorm(
    x: Tensor,
    y: Tensor,
    n: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """:func:`fused_add_layernorm` of arguments already validated (rows of at most
    ``MAX_ROW_BLOCK``): the routed op's call path (see ``run_layernorm``)."""
    w, b = param_row(weight, n), param_row(bias, n)
    return _add_layer_norm.on_rows(n, 2, x, y, w, b, eps, out_dtype)


_public_plans = PlanTable(lambda key: replay_add_layernorm(math.prod(key[1])))


def replay_add_layernorm(n: int) -> Replay:
    """The launch plan (:mod:`._infra._native`) of one call signature of
    :func:`run_add_layernorm`: ``replay.call(x, y, weight, bias, eps, out_dtype)``."""

    def reference(t, eps, out_dtype):
        w, b = param_row(t[2], n), param_row(t[3], n)
        return _add_layer_norm.function.apply(n, 2, t[0], t[1], w, b, eps, out_dtype)

    return Replay("xpuruntime::add_layer_norm", reference)

r"""fused_add_rmsnorm: a residual add and the RMS norm of its sum, in one kernel.

.. math::
    h = x + y,\qquad n = \mathrm{RMSNorm}(h)

as in a pre-norm decoder layer (Llama's ``hidden = residual + attn_out; residual =
hidden; hidden = post_attention_layernorm(hidden)``), where the sum is both the next
residual and the norm's input. Unfused, the add writes ``h`` and the norm reads it back;
in the backward the gradient reaching ``h`` from the norm and from the residual's other
user are summed by autograd (a kernel). Here the forward reads ``x`` and ``y`` once and
writes ``h`` and ``n``; the backward reads ``∂n``, ``h`` and ``∂h`` once and writes
``∂x`` and ``∂y`` in their own dtypes.

``h`` has the dtype PyTorch's add gives (the promotion of ``x`` and ``y``), computed in
fp32 and rounded once, as PyTorch computes it; the norm then reads the rounded ``h``, so
both outputs equal ``x + y`` followed by :func:`fused_rmsnorm`. The kernels are
fused_rmsnorm's own, in their residual variants. Rows wider than :data:`MAX_ROW_BLOCK`
take that unfused composition.
"""

import math

import torch
from torch import Tensor

from ._infra._launch import MAX_ROW_BLOCK
from ._infra._native import PlanTable, Replay, replayed_call
from ._infra._op import kernel_op
from ._infra._rows import check_residual_args, param_row, residual_grads, trained_dtypes
from .fused_rmsnorm import fused_rmsnorm, rmsnorm_backward, rmsnorm_forward

__all__ = ["fused_add_rmsnorm", "replay_add_rmsnorm", "run_add_rmsnorm"]


# -- launchers (dense (M, N) rows, N <= MAX_ROW_BLOCK): the RMS-norm kernels' residual
# variants ------------------------------------------------------------------------------------
def _forward(
    x: Tensor, y: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    normed = torch.empty_like(x, dtype=out_dtype)
    rstd = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    rmsnorm_forward(x, weight, eps, normed, rstd, residual=y, total=h)
    return h, normed, rstd


def _forward_alone(x, y, weight, eps, out_dtype) -> tuple[Tensor, Tensor]:
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    normed = torch.empty_like(x, dtype=out_dtype)
    rmsnorm_forward(x, weight, eps, normed, None, residual=y, total=h)
    return h, normed


def _forward_fake(x, y, weight, eps, out_dtype):
    h = torch.empty_like(x, dtype=torch.promote_types(x.dtype, y.dtype))
    return h, torch.empty_like(x, dtype=out_dtype), x.new_empty(x.shape[0], dtype=torch.float32)


def _backward(
    dn: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, rstd: Tensor,
    x_dtype: torch.dtype, y_dtype: torch.dtype, grad_dtype: torch.dtype, weight_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(∂x, ∂y, ∂weight); ∂y is ∂x itself when the dtypes match, and the weight gradient
    is summed in fp32 and written in ``grad_dtype`` (empty without a weight, or where
    ``weight_grad`` is False)."""
    dx = torch.empty_like(h, dtype=x_dtype)
    dy = None if y_dtype == x_dtype else torch.empty_like(h, dtype=y_dtype)
    dw = rmsnorm_backward(dn, h, weight, rstd, dx, grad_dtype, dres=dh, dx2=dy,
                          weight_grad=weight_grad)  # fmt: skip
    if dw is None:
        dw = h.new_empty(0, dtype=grad_dtype)
    return dx, dx if dy is None else dy, dw


def _backward_fake(dn, dh, h, weight, rstd, x_dtype, y_dtype, grad_dtype, weight_grad):
    n = h.shape[1]
    return (
        torch.empty_like(h, dtype=x_dtype),
        torch.empty_like(h, dtype=y_dtype),
        h.new_empty(n if weight is not None and weight_grad else 0, dtype=grad_dtype),
    )


def _save(inputs, outputs):
    x, y, weight = inputs[:3]
    h, _, rstd = outputs
    return (h, weight, rstd), ((x.dtype, y.dtype), trained_dtypes(weight)[0])


def _prepare(saved, state, dh, dn):
    """The backward's arguments from the gradients of ``h`` and ``n`` (either may be
    None: an output nothing used)."""
    h, weight, rstd = saved
    dn, dh = residual_grads(h, dh, dn)
    w_dtype = state[1]
    return dn, dh, h, weight, rstd, *state[0], w_dtype or torch.float32, w_dtype is not None


def _finish(state, grads):
    dx, dy, dw = grads
    return dx, dy, None if state[1] is None else dw, None, None


_add_rms_norm = kernel_op(
    "add_rms_norm",
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
def fused_add_rmsnorm(
    x: Tensor,
    y: Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``h = x + y`` and ``rms_norm(h)``, in one Triton kernel each way.

    Parameters
    ----------
    x, y : Tensor (..., *normalized_shape)
        The same shape (no broadcasting); fp32, fp16 or bf16, dtypes may differ (the sum
        takes PyTorch's promotion, e.g. fp32 for an fp32 residual plus a bf16 branch).
    normalized_shape : int or sequence of int
        The trailing dims normalised over.
    weight : Tensor of shape ``normalized_shape``, optional
        The norm's scale (its gradient comes back in its dtype).
    eps : float, optional
        Added to the mean square (None: the sum's dtype's epsilon, as ``nn.RMSNorm``).
    out_dtype : torch.dtype, optional
        The normalised output's dtype (default: the sum's).

    Returns
    -------
    (Tensor, Tensor)
        The sum, in the promoted dtype, and its RMS norm, in ``out_dtype``; both in
        ``x``'s shape. Gradients flow into ``x`` and ``y`` in their own dtypes.

    Raises
    ------
    InvalidInputError
        Shapes, dtypes or the weight do not match (the message says which).
    UnsupportedOperationError, BackendUnavailableError
        The tensors are not on a device Triton runs on, or Triton is missing.

    Examples
    --------
    >>> h, normed = fused_add_rmsnorm(residual, attn_out, 2048, norm.weight, 1e-5)  # doctest: +SKIP
    """
    planned = replayed_call(_public_plans, x, y, normalized_shape, eps, out_dtype, weight)
    if planned is not None:  # a call of a key checked before, run by its plan
        return planned
    shape, out_dtype = check_residual_args(
        "fused_add_rmsnorm", x, y, normalized_shape, (("weight", weight),), out_dtype
    )
    if eps is None:
        eps = torch.finfo(torch.promote_types(x.dtype, y.dtype)).eps
    n = math.prod(shape)
    if n > MAX_ROW_BLOCK:
        h = x + y
        return h, fused_rmsnorm(h, shape, weight, eps, out_dtype=out_dtype)
    planned = replayed_call(
        _public_plans, x, y, shape, eps, out_dtype, weight, checked=True
    )  # a key's second call derives its plan
    if planned is not None:
        return planned
    return run_add_rmsnorm(x, y, n, weight, float(eps), out_dtype)


def run_add_rmsnorm(
    x: Tensor, y: Tensor, n: int, weight: Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """:func:`fused_add_rmsnorm` of arguments already validated (rows of at most
    ``MAX_ROW_BLOCK``): the routed op's call path."""
    return _add_rms_norm.on_rows(n, 2, x, y, param_row(weight, n), eps, out_dtype)


_public_plans = PlanTable(lambda key: replay_add_rmsnorm(math.prod(key[1])))


def replay_add_rmsnorm(n: int) -> Replay:
    """The launch plan (:mod:`._infra._native`) of one call signature of
    :func:`run_add_rmsnorm`: ``replay.call(x, y, weight, None, eps, out_dtype)``."""

    def reference(t, eps, out_dtype):
        return _add_rms_norm.function.apply(n, 2, t[0], t[1], param_row(t[2], n), eps, out_dtype)

    return Replay("xpuruntime::add_rms_norm", reference)

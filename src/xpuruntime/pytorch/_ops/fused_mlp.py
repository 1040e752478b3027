r"""fused_mlp: a transformer's MLP, a linear layer, GELU and a linear layer, with GELU in
the epilogues of cuBLASLt's GEMMs.

.. math::
    p = x W_1^\top + b_1,\quad h = \mathrm{GELU}(p),\quad y = h W_2^\top + b_2

Forward: one cuBLASLt GEMM writes :math:`p` and :math:`h` (the ``GELU_AUX_BIAS``
epilogue), then ``F.linear``. Backward: the GEMM that forms :math:`\partial h = g W_2`
applies GELU's derivative in its epilogue (``DGELU``, reading the saved :math:`p`), so
:math:`\partial p` comes out of the GEMM where the layers one at a time write
:math:`\partial h` and read it back with :math:`p`; the parameter gradients are written
as :func:`.fused_linear` writes them (fp32 from the GEMMs' accumulators, the biases'
from Triton column sums). GELU is the tanh approximation (cuBLASLt's). See
:mod:`._infra._cublaslt` for what each epilogue measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._errors import InvalidInputError
from ._infra._cublaslt import dgelu_matmul, gelu_aux_linear, refusal, require
from ._infra._first_order import first_order
from ._infra._launch import autocast_dtype, require_triton, through_registered_op
from .fused_linear import check_linear, linear_parameter_grads

__all__ = ["fused_mlp", "unsupported"]


def mlp_forward(x, w1, b1, w2, b2) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h, p)`` for 2-D ``x`` and the compute-dtype parameters."""
    h, pre = gelu_aux_linear(x, w1, b1)
    return F.linear(h, w2, b2), h, pre


def mlp_backward(g, x, w1, w2, h, pre, dtypes) -> list[Tensor | None]:
    """The gradients of ``(x, w1, b1, w2, b2)`` in ``dtypes`` (None: not needed) from
    the output gradient ``g`` (M, out) and the forward's saved tensors."""
    x_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = dtypes
    dw2, db2 = linear_parameter_grads(g, h, w2_dtype, b2_dtype)
    dx = dw1 = db1 = None
    if x_dtype is not None or w1_dtype is not None or b1_dtype is not None:
        dpre = dgelu_matmul(g, w2, pre)
        dw1, db1 = linear_parameter_grads(dpre, x, w1_dtype, b1_dtype)
        if x_dtype is not None:
            dx = (dpre @ w1).to(x_dtype)
    return [dx, dw1, db1, dw2, db2]


# -- the torch ops (what torch.compile and the dispatch log see) -----------------------------
@torch.library.custom_op("xpuruntime::gelu_mlp", mutates_args=())
def _mlp_forward(
    x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return mlp_forward(x, w1, b1, w2, b2)


@_mlp_forward.register_fake
def _(x, w1, b1, w2, b2):
    h = x.new_empty((x.shape[0], w1.shape[0]))
    return x.new_empty((x.shape[0], w2.shape[0])), h, torch.empty_like(h)


@torch.library.custom_op("xpuruntime::gelu_mlp_backward", mutates_args=())
def _mlp_backward(
    g: Tensor,
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    h: Tensor,
    pre: Tensor,
    x_dtype: torch.dtype | None,
    w1_dtype: torch.dtype | None,
    b1_dtype: torch.dtype | None,
    w2_dtype: torch.dtype | None,
    b2_dtype: torch.dtype | None,
) -> list[Tensor]:
    dtypes = (x_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype)
    grads = mlp_backward(g, x, w1, w2, h, pre, dtypes)
    # Absent gradients come back as distinct empty tensors (outputs may not alias).
    return [g.new_empty(0) if t is None else t for t in grads]


@_mlp_backward.register_fake
def _(g, x, w1, w2, h, pre, *dtypes):
    shapes = (x.shape, w1.shape, w1.shape[:1], w2.shape, w2.shape[:1])
    return [
        g.new_empty(0) if dtype is None else g.new_empty(shape, dtype=dtype)
        for shape, dtype in zip(shapes, dtypes)
    ]


class _MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, compute_dtype):
        with torch.autocast(x.device.type, enabled=False):
            xc, w1c, b1c, w2c, b2c = (
                None if t is None else t.to(compute_dtype).contiguous() for t in (x, w1, b1, w2, b2)
            )
            xc = xc.reshape(-1, xc.shape[-1])
            args = (xc, w1c, b1c, w2c, b2c)
            y, h, pre = (_mlp_forward if through_registered_op() else mlp_forward)(*args)
        ctx.save_for_backward(xc, w1c, w2c, h, pre)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, w1, b1, w2, b2))
        ctx.input_shape = x.shape
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @first_order("fused_mlp")
    def backward(ctx, dy):
        xc, w1c, w2c, h, pre = ctx.saved_tensors
        g = dy.reshape(-1, dy.shape[-1]).to(h.dtype).contiguous()
        dtypes = [d if need else None for d, need in zip(ctx.dtypes, ctx.needs_input_grad)]
        if through_registered_op():
            grads = _mlp_backward(g, xc, w1c, w2c, h, pre, *dtypes)
            grads = [t if d is not None else None for t, d in zip(grads, dtypes)]
        else:
            grads = mlp_backward(g, xc, w1c, w2c, h, pre, dtypes)
        if grads[0] is not None:
            grads[0] = grads[0].view(ctx.input_shape)
        return (*grads, None)


def unsupported(
    device: torch.device,
    dtype: torch.dtype,
    in_features: int,
    hidden_features: int,
    out_features: int,
    approximate: str | None,
) -> str | None:
    """Why :func:`fused_mlp` cannot run an MLP (None when it can), the library aside."""
    refused = refusal(device, dtype, in_features, hidden_features, approximate)
    if refused is None and out_features % 8:
        refused = (
            "cuBLASLt's DGELU epilogue needs the second layer's out_features to be a "
            f"multiple of 8 (16-byte rows), got {out_features}"
        )
    return refused


def fused_mlp(
    input: Tensor,
    fc_weight: Tensor,
    fc_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor | None,
    approximate: str = "tanh",
) -> Tensor:
    """``F.linear(F.gelu(F.linear(input, fc_weight, fc_bias), approximate="tanh"),
    proj_weight, proj_bias)`` with GELU and its derivative in cuBLASLt's GEMM epilogues
    (see the module docstring).

    Runs on CUDA in bf16 or fp16 (the autocast dtype under autocast, else ``input``'s),
    with every feature count a multiple of 8; needs nvmath-python (cuBLASLt) and Triton
    (the bias gradients' column sums).

    Parameters
    ----------
    input : Tensor (..., in_features)
    fc_weight : Tensor (hidden_features, in_features)
    fc_bias : Tensor (hidden_features,), optional
    proj_weight : Tensor (out_features, hidden_features)
    proj_bias : Tensor (out_features,), optional
    approximate : {"tanh"}
        GELU's form, as ``F.gelu`` names it; cuBLASLt's epilogue computes the tanh form
        only, so "none" is refused rather than approximated.

    Returns
    -------
    Tensor (..., out_features)

    Raises
    ------
    InvalidInputError
        Mismatched shapes or non-float tensors, or (outside autocast) mixed dtypes.
    UnsupportedOperationError
        An MLP the epilogues cannot run (the message says why: device, dtype, GELU form,
        feature counts).
    BackendUnavailableError
        nvmath-python or Triton is missing.

    Examples
    --------
    >>> with torch.autocast("cuda", dtype=torch.bfloat16):                    # doctest: +SKIP
    ...     y = fused_mlp(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias)
    """
    check_linear("fused_mlp", input, fc_weight, fc_bias)
    if proj_weight.dim() != 2 or proj_weight.shape[1] != fc_weight.shape[0]:
        raise InvalidInputError(
            f"fused_mlp: proj_weight {tuple(proj_weight.shape)} must be (out_features, "
            f"{fc_weight.shape[0]}), taking the first layer's {fc_weight.shape[0]} outputs"
        )
    # The second layer's checks, on a stand-in for its (empty) input.
    second_input = input.new_empty((0, proj_weight.shape[1]))
    check_linear("fused_mlp (second layer)", second_input, proj_weight, proj_bias)
    tensors = [t for t in (input, fc_weight, fc_bias, proj_weight, proj_bias) if t is not None]
    require_triton("fused_mlp", *tensors)
    compute_dtype = autocast_dtype(input.device.type) or input.dtype
    features = (fc_weight.shape[1], fc_weight.shape[0], proj_weight.shape[0])
    require("fused_mlp", unsupported(input.device, compute_dtype, *features, approximate))
    return _MLPFunction.apply(input, fc_weight, fc_bias, proj_weight, proj_bias, compute_dtype)

"""Our ops' backwards give first derivatives only, and refuse a recorded backward.

Their backwards are kernels (Triton's, cuBLAS's, CUDA graphs replayed), not recorded
PyTorch ops. Autograd records a backward under ``create_graph=True``, as a gradient
penalty or a Hessian-vector product asks. The gradients' own graph would then miss what
the kernels computed, so a derivative through them would be silently wrong. Such a
backward raises :class:`~xpuruntime.UnsupportedOperationError` naming the op instead. The
model as written (the report's ``revert()``) is differentiated twice by autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ...._errors import UnsupportedOperationError

__all__ = ["first_order", "refuse_recorded_backward"]


def first_order(op: str) -> Callable[[Callable], Callable]:
    """Decorate the backward of an autograd Function of ``op``: where autograd records
    it (``create_graph=True``), it raises (:func:`refuse_recorded_backward`)."""

    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def checked(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled():  # (a backward runs with grad mode = create_graph)
                refuse_recorded_backward(op)
            return backward(ctx, *grads)

        return checked

    return wrap


def refuse_recorded_backward(op: str) -> None:
    """Raise the error of a backward of ``op`` that autograd was asked to record.

    Raises
    ------
    UnsupportedOperationError
        Always: what was asked, and what gives it.
    """
    raise UnsupportedOperationError(
        f"{op}'s backward runs kernels autograd does not record: it gives first "
        "derivatives only. A backward with create_graph=True (a gradient penalty, a "
        "second derivative) is not computed through it. The model as written (the "
        "optimize report's revert()), or PyTorch's own ops in its place, are "
        "differentiated twice."
    )

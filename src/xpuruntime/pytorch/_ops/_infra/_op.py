"""One of our ops from one triple of functions: the registered torch op and the eager
autograd Function, running the same code.

:func:`kernel_op` takes the forward and the backward (annotated, as
``torch.library.custom_op`` reads a schema from them), a fake implementation of each (the
output shapes torch.compile traces with), and how the backward is fed: ``save`` picks
what the forward keeps, ``prepare`` the backward's arguments from it and the output's
gradient, ``finish`` the inputs' gradients from the backward's results. From these it
registers ``xpuruntime::<name>`` and ``xpuruntime::<name>_backward`` (what
``torch.compile`` needs and what the dispatch log sees) and builds the autograd Function
that eager calls take (about a tenth of the registered op's host cost): one definition,
two call paths, as :func:`~._launch.through_registered_op` decides per call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._first_order import first_order
from ._launch import through_registered_op
from ._rows import as_rows, wants_grad

__all__ = ["KernelOp", "kernel_op"]


class KernelOp:
    """``op(*inputs)``: the forward's results (its first ``outputs``; the rest are what
    the backward needs), through the registered op when tracing or logging, through the
    forward alone when nothing needs a backward (where the op has one), else through
    the autograd Function."""

    def __init__(
        self,
        registered: Any,
        function: type[torch.autograd.Function],
        outputs: int,
        alone: Callable[..., tuple[torch.Tensor, ...]] | None,
        rows: Callable[[torch.Tensor, int], torch.Tensor] = as_rows,
    ) -> None:
        self.registered = registered
        """The registered torch op (``torch.ops.xpuruntime.<name>``'s callable)."""
        self.function = function
        self._outputs = outputs
        self._alone = alone
        self._rows = rows

    def __call__(self, *inputs: Any) -> Any:
        return self.on_rows(None, 0, *inputs)

    def on_rows(self, n: int | None, leading: int, *inputs: Any) -> Any:
        """The op on inputs whose first ``leading`` tensors are shaped (..., n), all alike:
        the op takes them as dense (rows, n) rows and its results come back in their
        shape. In the autograd Function the reshapes happen inside its forward and
        backward, so that autograd records no view nodes around the op: one node per
        call, as PyTorch's own norms have."""
        if through_registered_op():
            return self._direct(self.registered, n, leading, inputs, as_rows)
        if self._alone is not None and not wants_grad(*inputs):
            return self._direct(self._alone, n, leading, inputs, self._rows)
        return self.function.apply(n, leading, *inputs)

    def _direct(
        self, call: Callable[..., Any], n: int | None, leading: int, inputs: tuple, as_rows: Any
    ) -> Any:
        """``call`` (the registered op, or the forward alone) on the inputs as rows
        (``as_rows``), its results shaped back."""
        shape = inputs[0].shape if leading else None
        rows = [as_rows(t, n) for t in inputs[:leading]]
        results = call(*rows, *inputs[leading:])[: self._outputs]
        if shape is not None:
            results = tuple(r.view(shape) for r in results)
        return results[0] if self._outputs == 1 else results


def kernel_op(
    name: str,
    *,
    forward: Callable[..., tuple[torch.Tensor, ...]],
    forward_fake: Callable[..., tuple[torch.Tensor, ...]],
    backward: Callable[..., tuple[torch.Tensor, ...]],
    backward_fake: Callable[..., tuple[torch.Tensor, ...]],
    save: Callable[[tuple, tuple], tuple[tuple, Any]],
    prepare: Callable[..., tuple],
    finish: Callable[[Any, tuple], tuple],
    outputs: int = 1,
    alone: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    rows: Callable[[torch.Tensor, int], torch.Tensor] = as_rows,
) -> KernelOp:
    """Build :class:`KernelOp` ``xpuruntime::<name>`` from one definition.

    Parameters
    ----------
    forward, backward : callable
        The kernels' launchers on checked inputs, returning tuples of tensors; annotated.
        A backward output may be a view of another (rows of one buffer): the registered
        op returns a copy of it, as custom ops may not alias their outputs.
    forward_fake, backward_fake : callable
        Empty tensors shaped as each one's outputs.
    save : callable
        ``save(inputs, outputs) -> (tensors, state)``: what the backward needs.
    prepare : callable
        ``prepare(tensors, state, *grads) -> args``: the backward's arguments from the
        gradients of the op's results (None for a result nothing used).
    finish : callable
        ``finish(state, results) -> grads``: one gradient (or None) per input.
    outputs : int
        How many of the forward's outputs are the op's results.
    alone : callable, optional
        The forward when nothing needs the backward, on the forward's arguments:
        a tuple of the op's results alone (a norm then writes no statistics). Without
        it such calls take the autograd Function too.
    rows : callable
        ``rows(t, n)``: a leading input as the rows the eager forward takes (default
        :func:`~._rows.as_rows`, dense (rows, n); the registered op always takes those).
    """
    registered = torch.library.custom_op(f"xpuruntime::{name}", mutates_args=())(forward)
    registered.register_fake(forward_fake)

    def unaliased(*args: Any) -> tuple[torch.Tensor, ...]:
        seen: set[int] = set()
        out = []
        for t in backward(*args):
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            out.append(t.clone() if ptr in seen else t)
            if ptr is not None:
                seen.add(ptr)
        return tuple(out)

    # The schema is read from the signature; its annotations are evaluated here, in the
    # backward's own module (they may be strings there).
    unaliased.__signature__ = inspect.signature(backward, eval_str=True)  # type: ignore[attr-defined]
    registered_backward = torch.library.custom_op(f"xpuruntime::{name}_backward", mutates_args=())(
        unaliased
    )
    registered_backward.register_fake(backward_fake)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        tensors, ctx.state = save(inputs, output)
        ctx.save_for_backward(*tensors)

    def registered_grads(ctx: Any, *grads: Any) -> tuple:
        args = prepare(ctx.saved_tensors, ctx.state, *grads[:outputs])
        return finish(ctx.state, registered_backward(*args))

    registered.register_autograd(
        first_order(f"xpuruntime::{name}")(registered_grads), setup_context=setup_context
    )

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, n: int | None, leading: int, *inputs: Any) -> Any:
            if outputs > 1:
                ctx.set_materialize_grads(False)  # prepare() takes None for unused results
            ctx.shape = inputs[0].shape if leading else None
            ctx.n, ctx.leading = n, leading
            if leading:  # as rows, here where autograd records nothing
                inputs = (*(rows(t, n) for t in inputs[:leading]), *inputs[leading:])
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            results = output[:outputs]
            if leading:
                results = tuple(r.view(ctx.shape) for r in results)
            return results[0] if outputs == 1 else results

        @staticmethod
        @first_order(f"xpuruntime::{name}")
        def backward(ctx: Any, *grads: Any) -> tuple:
            shape = ctx.shape
            if shape is not None:  # the results' gradients as rows, the inputs' shaped back
                grads = tuple(None if g is None else g.reshape(-1, ctx.n) for g in grads)
            out = finish(ctx.state, backward(*prepare(ctx.saved_tensors, ctx.state, *grads)))
            if shape is not None:
                leading = ctx.leading
                out = tuple(
                    g.view(shape) if i < leading and g is not None else g for i, g in enumerate(out)
                )
            return (None, None, *out)

    Function.__name__ = Function.__qualname__ = f"{name}_function"
    return KernelOp(registered, Function, outputs, alone, rows)

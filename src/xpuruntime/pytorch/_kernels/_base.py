"""What every PyTorch kernel is: a named choice for one op that answers ``supports``
with a reason and, for the ops routed per call, runs itself."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..._errors import UnsupportedOperationError
from ...kernels import Support
from ...policies._choices import KERNEL_CHOICES

__all__ = [
    "KERNELS",
    "RunsAnything",
    "TorchKernel",
    "TritonKernel",
    "auto_order",
    "cudnn_missing",
    "replayable",
    "triton_refusal",
]

KERNELS: list[type[TorchKernel]] = []
"""Every concrete kernel class, in the order their modules define them."""


def auto_order(op: str) -> list[str]:
    """``op``'s kernels in the auto preference order: the policy vocabulary's order."""
    return [name for name in KERNEL_CHOICES[op] if name != "auto"]


class TorchKernel(ABC):
    """A named choice for one op; subclasses answer ``supports``, and the kernels of a
    routed op (:class:`~.._routed.RoutedOp`) run themselves: ``runner()`` gives the
    callable that takes the op's arguments (what the op caches per call signature)."""

    op: ClassVar[str]
    name: ClassVar[str]
    summary: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "summary" in cls.__dict__:  # a concrete kernel (its own summary), not a base
            KERNELS.append(cls)

    @abstractmethod
    def supports(self, ctx: Any) -> Support:
        """Can this kernel run ``ctx``? Always with a reason."""

    def runner(self) -> Any:
        """The callable running this kernel on the op's arguments (imports what it
        needs once, so that the call itself does not)."""
        raise UnsupportedOperationError(
            f"{self!r} takes effect through PyTorch's switches; it has no call of its own"
        )

    def planned(self, ctx: Any) -> Any:
        """The runner for the calls of one signature (``ctx`` describes them): the
        kernel's runner, or one prepared for that signature, such as our Triton norms'
        launch plans run from C++ (:mod:`.._ops._infra._native`)."""
        return self.runner()

    def timed(self, runner: Any) -> Any:
        """What a timing of this kernel runs, given the runner its calls get: that
        runner (a kernel whose calls leave the work to someone else times that work)."""
        return runner

    def direct(self) -> Any:
        """A runner that may be called without resolving the call first, because it
        refuses (raises) every call it cannot run exactly as ``supports`` would; None
        when the kernel has none. A routed op whose policy names this kernel calls it
        first once a call has resolved to the kernel."""
        return None

    def run(self, *args: Any) -> Any:
        """Run this kernel on the op's arguments."""
        return self.runner()(*args)

    def __repr__(self) -> str:
        return f"<{self.op} kernel {self.name!r}>"


class RunsAnything(TorchKernel):
    """A choice that runs every call of its op (PyTorch's own kernels or routing)."""

    why: ClassVar[str]

    def supports(self, ctx: Any) -> Support:
        return Support.yes(self.why)


class TritonKernel(TorchKernel):
    """One of our Triton kernels: it runs where Triton runs, on fp32, fp16 and bf16."""

    def supports(self, ctx: Any) -> Support:
        from .._ops._infra._launch import FLOAT_DTYPES

        refused = triton_refusal(ctx.device)
        if refused is not None:
            return refused
        dtype = self._dtype(ctx)
        if dtype not in FLOAT_DTYPES:
            return Support.no(f"{self._takes} fp32, fp16 and bf16, not {dtype}")
        return self._supports_triton(ctx)

    @property
    def _takes(self) -> str:
        """The subject and verb of the dtype refusal ("our layernorm kernels take")."""
        return f"our {self.op} kernels take"

    def _dtype(self, ctx: Any) -> torch.dtype:
        return ctx.dtype

    @abstractmethod
    def _supports_triton(self, ctx: Any) -> Support:
        """The kernel's own conditions, once Triton and the dtype are known to fit."""


def triton_refusal(device: torch.device) -> Support | None:
    """Why our Triton kernels cannot run on ``device`` (None when they can)."""
    from .._ops._infra._launch import triton_unavailable

    why = triton_unavailable(device)
    return None if why is None else Support(False, why, missing_backend="not installed" in why)


def replayable(device: torch.device) -> bool:
    """Whether our Triton kernels' launch programs may be replayed from C++ on
    ``device`` (:mod:`.._ops._infra._native`; the C++ side is built on first use)."""
    if device.type != "cuda":
        return False
    from .._ops._infra._native import unavailable

    return unavailable() is None


def cudnn_missing() -> str | None:
    """Why cuDNN cannot run here (None when it can)."""
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to this torch build"
    return None

"""The PyTorch kernels a policy chooses among, one class each, in one module per op.

A kernel answers ``supports(ctx)`` with a reason and, for the ops routed per call,
runs itself (``runner()``). Adding a kernel is one class in one module here, its name in
the policy vocabulary (:data:`~xpuruntime.policies._choices.KERNEL_CHOICES`, whose order
is the auto order) and its module in the import below.
"""

from ...kernels import registry
from . import (  # noqa: F401
    activations,
    attention,
    conv,
    flash_v4,
    fp8,
    linear,
    lora,
    loss,
    matmul,
    norm_rope,
    norms,
    rope,
)
from ._base import KERNELS, TorchKernel, auto_order
from .attention import NONDETERMINISTIC_SDPA

__all__ = ["NONDETERMINISTIC_SDPA", "TorchKernel", "auto_order", "register_kernels"]


def register_kernels() -> None:
    """Register every PyTorch kernel (idempotent), in each op's auto order."""
    kernels: dict[str, dict[str, TorchKernel]] = {}
    for cls in KERNELS:
        kernels.setdefault(cls.op, {})[cls.name] = cls()
    for op, named in kernels.items():
        for name in auto_order(op):  # registration order = the auto order
            if name not in registry.names(op):
                registry.register(op, named[name])

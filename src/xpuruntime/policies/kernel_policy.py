"""The seed documents' import path for :class:`KernelPolicy`
(``from xpuruntime.policies.kernel_policy import KernelPolicy``)."""

from ._choices import AutoSelectStrategy
from ._kernel_policy import KernelPolicy

__all__ = ["AutoSelectStrategy", "KernelPolicy"]

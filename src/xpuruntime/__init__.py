"""xpuruntime: one explicit, serializable policy for where and how models run.

``import xpuruntime as xrt`` is light: it loads neither numpy nor any backend. The
inference API (``InferenceSession``, ``compare``) loads on first use.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import Any

from ._errors import (
    BackendUnavailableError,
    CudaError,
    ExecutionError,
    InvalidInputError,
    ModelLoadError,
    OutOfMemoryError,
    PolicyError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from ._files import default_cache_dir
from .kernels import (
    Decision,
    FallbackWarning,
    KernelRegistry,
    Support,
    clear_dispatch_logs,
    disable_dispatch_logging,
    enable_dispatch_logging,
    export_dispatch_logs,
    get_dispatch_logs,
)
from .policies import AccuracyPolicy, AutoSelectStrategy, ExecutionPolicy, KernelPolicy
from .runtime import (
    Device,
    DeviceInfo,
    DeviceManager,
    Profiler,
    get_all_devices,
    get_current_device,
    get_device_count,
    set_current_device,
    synchronize,
)

__version__ = "0.1.0"

# A library's loggers stay silent unless the application configures logging (without
# this, Python's last-resort handler prints every warning a second time, next to the
# ``warnings`` message the user sees).
logging.getLogger("xpuruntime").addHandler(logging.NullHandler())

_LAZY = {
    "InferenceSession": "xpuruntime.inference",
    "compare": "xpuruntime.inference",
    "ComparisonReport": "xpuruntime.inference",
    "TensorSpec": "xpuruntime.inference",
    "Tensor": "xpuruntime.runtime",
}
_SUBPACKAGES = ("engines", "inference", "runtime")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return import_module(f"xpuruntime.{name}")
    if name == "pytorch":  # 03_python_binding §7.1: loaded on first use, torch with it
        try:
            return import_module("xpuruntime.pytorch")
        except ImportError as e:
            if e.name != "torch":
                raise
            raise ImportError(
                "xpuruntime.pytorch requires PyTorch. Install with: pip install xpuruntime[torch]",
                name="torch",
            ) from e
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xpuruntime' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AccuracyPolicy",
    "AutoSelectStrategy",
    "BackendUnavailableError",
    "ComparisonReport",
    "CudaError",
    "Decision",
    "Device",
    "DeviceInfo",
    "DeviceManager",
    "ExecutionError",
    "ExecutionPolicy",
    "FallbackWarning",
    "InferenceSession",
    "InvalidInputError",
    "KernelPolicy",
    "KernelRegistry",
    "ModelLoadError",
    "OutOfMemoryError",
    "PolicyError",
    "Profiler",
    "Support",
    "Tensor",
    "TensorSpec",
    "UnsupportedOperationError",
    "XpuRuntimeError",
    "__version__",
    "clear_dispatch_logs",
    "compare",
    "default_cache_dir",
    "disable_dispatch_logging",
    "enable_dispatch_logging",
    "export_dispatch_logs",
    "get_all_devices",
    "get_current_device",
    "get_device_count",
    "get_dispatch_logs",
    "set_current_device",
    "synchronize",
]

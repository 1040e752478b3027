"""Low-level runtime: devices, CUDA streams, events, graphs and memory, the Profiler.

The CUDA parts speak to the driver through NVIDIA's cuda-bindings (``pip install
xpuruntime[cuda]``); they need neither PyTorch nor CuPy, and interoperate with both.
"""

from importlib import import_module
from typing import Any

from ._device import (
    DEVICE_KINDS,
    Device,
    DeviceInfo,
    DeviceManager,
    get_all_devices,
    get_current_device,
    get_device_count,
    set_current_device,
    synchronize,
)
from ._discovery import ProbeReport
from ._graph import CudaGraph
from ._profiler import Profiler
from ._stream import Event, Stream

_LAZY = {  # these need numpy, which `import xpuruntime` does not load
    "DeviceArray": "._memory",
    "DeviceBuffer": "._memory",
    "MemoryManager": "._memory",
    "MemoryStats": "._memory",
    "PinnedBuffer": "._memory",
    "Tensor": "._tensor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xpuruntime.runtime' has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


__all__ = [
    "DEVICE_KINDS",
    "CudaGraph",
    "Device",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceInfo",
    "DeviceManager",
    "Event",
    "MemoryManager",
    "MemoryStats",
    "PinnedBuffer",
    "ProbeReport",
    "Profiler",
    "Stream",
    "Tensor",
    "get_all_devices",
    "get_current_device",
    "get_device_count",
    "set_current_device",
    "synchronize",
]

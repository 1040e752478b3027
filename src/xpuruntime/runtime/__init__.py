"""Low-level runtime: devices and their discovery."""

from ._device import DEVICE_KINDS, Device, DeviceInfo
from ._device_manager import (
    DeviceManager,
    get_all_devices,
    get_current_device,
    get_device_count,
    set_current_device,
    synchronize,
)
from ._discovery import ProbeReport

__all__ = [
    "DEVICE_KINDS",
    "Device",
    "DeviceInfo",
    "DeviceManager",
    "ProbeReport",
    "get_all_devices",
    "get_current_device",
    "get_device_count",
    "set_current_device",
    "synchronize",
]

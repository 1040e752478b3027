"""DeviceManager: discovery results, the current device, synchronisation."""

from __future__ import annotations

import threading

from .._errors import CudaError, InvalidInputError, UnsupportedOperationError
from ._cuda import check, free_memory, make_current
from ._device import Device, DeviceInfo, as_device
from ._discovery import ProbeReport, probe_all

__all__ = [
    "DeviceManager",
    "get_all_devices",
    "get_current_device",
    "get_device_count",
    "set_current_device",
    "synchronize",
]


class DeviceManager:
    """The process's view of its devices; probes once, on first use.

    Use :meth:`instance`. The current device is process-wide (not per thread) and
    starts as ``cpu``.
    """

    _instance: DeviceManager | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: list[ProbeReport] | None = None
        self._current = Device("cpu")

    @classmethod
    def instance(cls) -> DeviceManager:
        """The process-wide manager."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    # -- discovery --------------------------------------------------------------------
    @property
    def probes(self) -> list[ProbeReport]:
        """Every probe's report: what it found, or why it found nothing."""
        with self._lock:
            if self._reports is None:
                self._reports = probe_all()
            return list(self._reports)

    def refresh(self) -> None:
        """Forget the cached discovery; the next query probes again."""
        with self._lock:
            self._reports = None

    @property
    def devices(self) -> list[DeviceInfo]:
        """Every device found, host CPU first."""
        seen: set[Device] = set()
        found = []
        for report in self.probes:
            for info in report.devices:
                if info.device not in seen:  # cuda-bindings and NVML may both report a GPU
                    seen.add(info.device)
                    found.append(info)
        return found

    def find(self, device: Device | str | int) -> DeviceInfo | None:
        """The DeviceInfo for ``device``, or None if discovery did not find it."""
        device = as_device(device)
        return next((info for info in self.devices if info.device == device), None)

    def get_device_info(self, device: Device | str | int) -> DeviceInfo:
        """The DeviceInfo for ``device``; raises if it does not exist.

        Raises
        ------
        CudaError
            For a CUDA device that was not found; says how many there are and why.
        UnsupportedOperationError
            For any other device that was not found.
        """
        device = Device(device)
        info = self.find(device)
        if info is not None:
            return info
        same_kind = [str(i.device) for i in self.devices if i.kind == device.kind]
        why = "; ".join(
            f"{r.backend}: {r.detail}"
            for r in self.probes
            if not r.ok or r.backend in ("cuda-bindings", "nvml", "openvino")
        )
        message = f"device {device} not found (found {same_kind or 'none'} of kind {device.kind!r}"
        message += f"; {why})" if why else ")"
        if device.kind == "cuda":
            raise CudaError(message, code="CUDA_ERROR_INVALID_DEVICE")
        raise UnsupportedOperationError(message)

    def get_device_count(self, kind: str | None = None) -> int:
        """How many devices there are (of ``kind``, if given), the host CPU included."""
        return sum(1 for info in self.devices if kind is None or info.kind == kind)

    def memory_info(self, device: Device | str | int | None = None) -> tuple[int, int]:
        """``(free, total)`` bytes on ``device`` (default: current), read now.

        CUDA devices ask the driver (``cuMemGetInfo``); other devices report what
        discovery saw (free may be None there).

        Raises
        ------
        CudaError, UnsupportedOperationError
            For a device that does not exist.
        """
        device = self._current if device is None else Device(device)
        info = self.get_device_info(device)
        if device.kind == "cuda":
            return free_memory(device.index)
        return info.free_memory, info.total_memory

    # -- current device ------------------------------------------------------------------
    def get_current_device(self) -> Device:
        return self._current

    def set_current_device(self, device: Device | str | int) -> None:
        """Make ``device`` current; for CUDA, its primary context becomes current too."""
        device = Device(device)
        self.get_device_info(device)
        if device.kind == "cuda":
            make_current(device.index)
        self._current = device

    def get_all_devices(self) -> list[DeviceInfo]:
        """Every device found, as :class:`DeviceInfo` (the seed API's name for
        :attr:`devices`)."""
        return self.devices

    def synchronize(
        self, device: Device | str | int | None = None, *, device_id: int | None = None
    ) -> None:
        """Wait for queued work on ``device`` (default: the current device).

        ``device_id`` is the seed API's form: a CUDA index, -1 for the current device.
        The CPU and OpenVINO devices run synchronously for xpuruntime's sessions, so
        there is nothing to wait for; CUDA devices synchronise their primary context.
        """
        if device_id is not None:
            if device is not None:
                raise InvalidInputError("synchronize: pass device or device_id, not both")
            device = None if device_id == -1 else device_id
        device = self._current if device is None else Device(device)
        self.get_device_info(device)
        if device.kind == "cuda":
            cu = make_current(device.index)
            check(cu.cuCtxSynchronize(), f"cuCtxSynchronize on {device}")


def get_device_count(kind: str | None = None) -> int:
    """Number of devices found (of ``kind`` if given), the host CPU included."""
    return DeviceManager.instance().get_device_count(kind)


def get_all_devices() -> list[Device]:
    """Every device found, host CPU first."""
    return [info.device for info in DeviceManager.instance().devices]


def get_current_device() -> Device:
    """The process-wide current device (``cpu`` until :func:`set_current_device`)."""
    return DeviceManager.instance().get_current_device()


def set_current_device(device: Device | str | int) -> None:
    """Make ``device`` the current device; raises if it does not exist."""
    DeviceManager.instance().set_current_device(device)


def synchronize(device: Device | str | int | None = None, *, device_id: int | None = None) -> None:
    """Wait until queued work on ``device`` (default: current) has finished;
    ``device_id=-1`` (the seed API's form) also means the current device."""
    DeviceManager.instance().synchronize(device, device_id=device_id)

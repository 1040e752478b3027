"""Device: a named place to run (``cpu``, ``cuda:N``, ``gpu:N``, ``npu:N``, ``auto``).

Constructing a :class:`Device` parses its name and touches no hardware; the first query
of a property that needs the hardware (``name``, ``total_memory``, ...) asks the
:class:`DeviceManager` (here too: a device's facts and the process's view of its devices
refer to each other), which probes once (:mod:`._discovery`) and caches.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from .._errors import CudaError, InvalidInputError, UnsupportedOperationError
from ._cuda import check, free_memory, make_current
from ._discovery import ProbeReport, probe_all

__all__ = [
    "DEVICE_KINDS",
    "Device",
    "DeviceInfo",
    "DeviceManager",
    "get_all_devices",
    "get_current_device",
    "get_device_count",
    "set_current_device",
    "synchronize",
]

# cpu: the host. cuda: NVIDIA GPUs (CUDA driver). gpu: other GPUs (OpenVINO's GPU plugin,
# Intel). npu: neural processing units (OpenVINO NPU, Qualcomm QNN). auto: let the
# engine's own device plugin choose (OpenVINO AUTO).
DEVICE_KINDS = ("cpu", "cuda", "gpu", "npu", "auto")
_SPEC = re.compile(r"^(cpu|cuda|gpu|npu|auto)(?::(\d+))?$")


class Device:
    """A device to run on, by kind and index.

    Parameters
    ----------
    spec : str, int or Device
        ``"cpu"``, ``"cuda"`` / ``"cuda:N"``, ``"gpu[:N]"``, ``"npu[:N]"`` or ``"auto"``
        (case-insensitive): a name, checked against the hardware only when queried. An
        int ``N`` means CUDA device ``N`` as in the seed API, whose ``Device(i)`` reads
        the device's information at construction: a device that does not exist raises
        at once.

    Raises
    ------
    InvalidInputError
        If ``spec`` is not one of those forms.
    CudaError
        For an int ``N`` with no such CUDA device (on a machine without CUDA too).

    Examples
    --------
    >>> Device("cuda:1").kind, Device("cuda:1").index
    ('cuda', 1)
    >>> str(Device("cuda"))
    'cuda:0'
    """

    __slots__ = ("_index", "_kind")

    def __init__(self, spec: str | int | Device = "cpu") -> None:
        if isinstance(spec, Device):
            self._kind, self._index = spec._kind, spec._index
            return
        if isinstance(spec, int) and not isinstance(spec, bool):
            if spec < 0:
                raise InvalidInputError(f"device: index must be >= 0, got {spec}")
            self._kind, self._index = "cuda", spec
            self.info  # the seed API's Device(i) reads the device: a missing one raises now
            return
        match = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
        if match is None:
            raise InvalidInputError(
                "device: expected 'cpu', 'cuda[:N]', 'gpu[:N]', 'npu[:N]', 'auto' or an "
                f"int CUDA index, got {spec!r}"
            )
        kind, index = match.group(1), match.group(2)
        if kind in ("cpu", "auto") and index not in (None, "0"):
            raise InvalidInputError(f"device: {kind!r} takes no index, got {spec!r}")
        self._kind, self._index = kind, int(index or 0)

    # -- identity ------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """One of ``cpu``, ``cuda``, ``gpu``, ``npu``, ``auto``."""
        return self._kind

    @property
    def index(self) -> int:
        """The index among devices of this kind (0 for ``cpu`` and ``auto``)."""
        return self._index

    @property
    def id(self) -> int:
        """Alias of :attr:`index` (the seed API's name)."""
        return self._index

    # -- hardware queries (probed once, through the DeviceManager) ---------------------
    @property
    def info(self) -> DeviceInfo:
        """The :class:`DeviceInfo` for this device.

        Raises
        ------
        CudaError
            For a ``cuda`` device that does not exist (with the probe's reason).
        UnsupportedOperationError
            For another device that discovery did not find.
        """
        return DeviceManager.instance().get_device_info(self)

    @property
    def exists(self) -> bool:
        """Whether discovery found this device (``auto`` always exists)."""
        return self._kind == "auto" or DeviceManager.instance().find(self) is not None

    @property
    def name(self) -> str:
        """The device's marketing name, as its backend reports it."""
        return self.info.name

    @property
    def total_memory(self) -> int | None:
        """Total memory in bytes, when the backend reports it."""
        return self.info.total_memory

    @property
    def total_memory_gb(self) -> float | None:
        """Total memory in GiB (the seed API's name), or None where unknown."""
        total = self.total_memory
        return None if total is None else total / 2**30

    @property
    def free_memory(self) -> int | None:
        """Free memory in bytes, read now for CUDA devices (``cuMemGetInfo``)."""
        return DeviceManager.instance().memory_info(self)[0]

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """CUDA compute capability ``(major, minor)``; None for other kinds."""
        return self.info.compute_capability

    @property
    def sm_count(self) -> int | None:
        """Number of streaming multiprocessors (CUDA); None for other kinds."""
        return self.info.sm_count

    @property
    def driver_version(self) -> str | None:
        """The CUDA driver's version (``"13.0"``); None for other kinds."""
        return self.info.details.get("driver_version")

    @property
    def supports_fp16(self) -> bool:
        return self.info.supports_fp16

    @property
    def supports_bf16(self) -> bool:
        return self.info.supports_bf16

    @property
    def supports_int8(self) -> bool:
        return self.info.supports_int8

    def synchronize(self) -> None:
        """Wait until all work queued on this device has finished."""
        DeviceManager.instance().synchronize(self)

    def __str__(self) -> str:
        return self._kind if self._kind in ("cpu", "auto") else f"{self._kind}:{self._index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, int)) and not isinstance(other, bool):
            try:
                other = as_device(other)
            except InvalidInputError:
                return False
        if not isinstance(other, Device):
            return NotImplemented
        return (self._kind, self._index) == (other._kind, other._index)

    def __hash__(self) -> int:
        return hash((self._kind, self._index))


def as_device(spec: str | int | Device) -> Device:
    """``Device(spec)`` without the seed form's hardware check: an int is read as the
    name ``cuda:N`` (for comparisons and lookups, which must not raise for a missing
    device)."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return Device(f"cuda:{spec}")
    return Device(spec)


@dataclass(frozen=True)
class DeviceInfo:
    """What discovery learned about one device.

    ``free_memory`` is a reading taken at discovery time (None where the backend cannot
    tell without side effects). ``backend`` names who reported the device: ``os`` for the
    host CPU, ``cuda-bindings`` or ``nvml`` for NVIDIA GPUs, ``openvino`` for its devices.
    """

    device_id: int
    kind: str
    name: str
    backend: str
    total_memory: int | None = None
    free_memory: int | None = None
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    supports_fp16: bool = False
    supports_bf16: bool = False
    supports_int8: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def device(self) -> Device:
        """The :class:`Device` this describes."""
        return Device(self.kind if self.kind == "cpu" else f"{self.kind}:{self.device_id}")

    @property
    def compute_capability_major(self) -> int | None:
        return None if self.compute_capability is None else self.compute_capability[0]

    @property
    def compute_capability_minor(self) -> int | None:
        return None if self.compute_capability is None else self.compute_capability[1]

    def __repr__(self) -> str:
        memory = "" if self.total_memory is None else f", {self.total_memory / 2**30:.1f} GiB"
        return f"<DeviceInfo {self.device}: {self.name} ({self.backend}{memory})>"


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
                self._reports = probe_all(DeviceInfo)
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

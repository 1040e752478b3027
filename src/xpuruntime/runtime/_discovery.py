"""Device discovery probes: the host CPU, NVIDIA GPUs, OpenVINO devices, ORT providers.

Each probe returns a :class:`ProbeReport`; a probe that fails reports why (and logs it)
instead of raising, so that listing devices never crashes. What a probe found it makes
with the record type the caller passes (:class:`.._device.DeviceInfo`, which stands
above this file: a device's facts refer to the device and to this discovery).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ProbeReport", "probe_all"]

logger = logging.getLogger("xpuruntime.runtime")


@dataclass(frozen=True)
class ProbeReport:
    """What one discovery probe found (``ok``) or why it found nothing (``detail``)."""

    backend: str
    ok: bool
    detail: str
    devices: tuple[Any, ...] = field(default=())  # the records the caller had made


def probe_all(record: Callable[..., Any]) -> list[ProbeReport]:
    """Run every probe; failures become reports with a reason, never exceptions. Each
    device found is ``record(device_id=..., kind=..., name=..., backend=..., ...)``
    (:class:`~xpuruntime.runtime.DeviceInfo`'s fields)."""
    reports = []
    for probe in (_probe_host, _probe_cuda, _probe_openvino, _probe_onnxruntime):
        try:
            report = probe(record)
        except Exception as e:  # a probe must never take discovery down
            report = ProbeReport(probe.__name__.removeprefix("_probe_"), False, repr(e))
        if not report.ok:
            logger.info("device probe %s found nothing: %s", report.backend, report.detail)
        reports.append(report)
    return reports


def _cpu_flags() -> tuple[str, set[str]]:
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "cpu", flags


def _host_memory() -> tuple[int | None, int | None]:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    available = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return total, available


def usable_cores() -> int:
    """The logical cores this process may run on (its CPU affinity, which a container's
    cpuset narrows), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def describe_host_memory() -> str:
    """What bounds this process's host memory, for an out-of-memory message: the memory
    available now, and the address-space (``RLIMIT_AS``) and cgroup limits where set."""
    parts = []
    _, available = _host_memory()
    if available is not None:
        parts.append(f"{available / 2**30:.2f} GiB available")
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            parts.append(f"address-space limit (RLIMIT_AS) {soft / 2**30:.2f} GiB")
    except (ImportError, OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="utf-8") as f:
            cgroup = f.read().strip()
        if cgroup.isdigit():
            parts.append(f"cgroup limit {int(cgroup) / 2**30:.2f} GiB")
    except OSError:
        pass
    return ", ".join(parts) or "host memory limits unknown"


def _probe_host(record: Callable[..., Any]) -> ProbeReport:
    name, flags = _cpu_flags()
    total, available = _host_memory()
    info = record(
        device_id=0,
        kind="cpu",
        name=name,
        backend="os",
        total_memory=total,
        free_memory=available,
        # Native arithmetic in these types, not emulation: what makes them worth asking for.
        supports_fp16=bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}),
        supports_bf16=bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}),
        supports_int8=bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"}),
        details={"cores": os.cpu_count(), "arch": platform.machine()},
    )
    return ProbeReport("os", True, f"{os.cpu_count()} logical cores", (info,))


def _probe_cuda(record: Callable[..., Any]) -> ProbeReport:
    if _has_cuda_bindings():
        report = _probe_cuda_bindings(record)
        if report.ok or importlib.util.find_spec("pynvml") is None:
            return report
    if importlib.util.find_spec("pynvml") is not None:
        return _probe_nvml(record)
    return ProbeReport(
        "cuda",
        False,
        "neither cuda-bindings nor nvidia-ml-py is installed (pip install xpuruntime[cuda])",
    )


def _has_cuda_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        return False


def _probe_cuda_bindings(record: Callable[..., Any]) -> ProbeReport:
    from .._errors import XpuRuntimeError
    from ._cuda import check, driver

    try:
        cu = driver()
        version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        attr = cu.CUdevice_attribute
        devices = []
        for index in range(count):
            dev = check(cu.cuDeviceGet(index), "cuDeviceGet")
            name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
            major = check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                "cuDeviceGetAttribute",
            )
            minor = check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                "cuDeviceGetAttribute",
            )
            sms = check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                "cuDeviceGetAttribute",
            )
            devices.append(
                _cuda_info(
                    record,
                    index,
                    name.split(b"\0", 1)[0].decode(),
                    int(check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
                    _nvml_free_memory(index),
                    (major, minor),
                    sms,
                    "cuda-bindings",
                    {"driver_version": f"{version // 1000}.{version % 1000 // 10}"},
                )
            )
    except XpuRuntimeError as e:
        return ProbeReport("cuda-bindings", False, str(e))
    return ProbeReport(
        "cuda-bindings", True, f"driver {version}, {count} device(s)", tuple(devices)
    )


def _nvml_free_memory(index: int) -> int | None:
    """Free memory without creating a CUDA context (which would cost ~300 MiB per GPU)."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        logger.debug("NVML free-memory query failed for cuda:%d: %r", index, e)
        return None


def _probe_nvml(record: Callable[..., Any]) -> ProbeReport:
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception as e:
        return ProbeReport("nvml", False, f"nvmlInit failed: {e}")
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append(
                _cuda_info(
                    record,
                    index,
                    name.decode() if isinstance(name, bytes) else name,
                    int(memory.total),
                    int(memory.free),
                    tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                    None,  # NVML does not report the SM count
                    "nvml",
                    {"driver_version": version},
                )
            )
    except Exception as e:
        return ProbeReport("nvml", False, f"NVML query failed: {e}")
    finally:
        pynvml.nvmlShutdown()
    return ProbeReport("nvml", True, f"driver {version}, {len(devices)} device(s)", tuple(devices))


def _cuda_info(record, index, name, total, free, cc, sms, backend, details) -> Any:
    return record(
        device_id=index,
        kind="cuda",
        name=name,
        backend=backend,
        total_memory=total,
        free_memory=free,
        compute_capability=cc,
        sm_count=sms,
        supports_fp16=cc >= (5, 3),
        supports_bf16=cc >= (8, 0),
        supports_int8=cc >= (6, 1),
        details=details,
    )


def _probe_openvino(record: Callable[..., Any]) -> ProbeReport:
    if importlib.util.find_spec("openvino") is None:
        return ProbeReport("openvino", False, "not installed (pip install xpuruntime[openvino])")
    import openvino as ov

    core = ov.Core()
    devices, names = [], list(core.available_devices)
    for device_name in names:
        kind, _, suffix = device_name.partition(".")
        kind = kind.lower()
        if kind == "cpu" or kind not in ("gpu", "npu"):
            continue  # the host CPU is reported by the OS probe
        caps = set(core.get_property(device_name, "OPTIMIZATION_CAPABILITIES"))
        total = None
        if kind == "gpu":
            try:
                total = int(core.get_property(device_name, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            except Exception:
                total = None
        devices.append(
            record(
                device_id=int(suffix or 0),
                kind=kind,
                name=str(core.get_property(device_name, "FULL_DEVICE_NAME")),
                backend="openvino",
                total_memory=total,
                supports_fp16="FP16" in caps,
                supports_bf16="BF16" in caps,
                supports_int8="INT8" in caps,
                details={"openvino_name": device_name, "capabilities": sorted(caps)},
            )
        )
    return ProbeReport("openvino", True, f"{ov.__version__}: {', '.join(names)}", tuple(devices))


def _probe_onnxruntime(record: Callable[..., Any]) -> ProbeReport:
    if importlib.util.find_spec("onnxruntime") is None:
        return ProbeReport(
            "onnxruntime", False, "not installed (pip install xpuruntime[onnxruntime])"
        )
    import onnxruntime as ort

    providers = ", ".join(ort.get_available_providers())
    return ProbeReport("onnxruntime", True, f"{ort.__version__}: {providers}")

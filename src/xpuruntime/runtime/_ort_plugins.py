"""ONNX Runtime's execution-provider devices, plugin EPs registered once per process.

ONNX Runtime >= 1.24 lists the devices each EP can use (``get_ep_devices()``); a plugin
EP shipped as its own package (onnxruntime-qnn) appears there only after its library is
registered with ``register_execution_provider_library``. Registration is process-wide
and happens here, once, for every plugin package that is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["EpDevice", "PLUGIN_EPS", "ep_devices", "plugin_problem"]

logger = logging.getLogger("xpuruntime.runtime")

PLUGIN_EPS = {"QNNExecutionProvider": "onnxruntime_qnn"}
"""Plugin EP name -> the Python package whose ``get_library_path()`` holds it."""

_lock = threading.Lock()
_problems: dict[str, str] | None = None


@dataclass(frozen=True)
class EpDevice:
    """One (EP, device) pair ONNX Runtime offers.

    ``emulated`` is True where a plugin EP for an accelerator reports the host CPU as
    its device (QNN's HTP backend in emulation on x86_64).
    """

    ep: str
    ep_vendor: str
    device_type: str
    device_vendor: str
    emulated: bool
    handle: Any


def _register() -> dict[str, str]:
    """Register installed plugin EPs; returns EP -> why it could not be registered."""
    global _problems
    with _lock:
        if _problems is None:
            _problems = {}
            ort = importlib.import_module("onnxruntime")
            if not hasattr(ort, "register_execution_provider_library"):
                _problems = {
                    ep: f"onnxruntime {ort.__version__} has no plugin EP API" for ep in PLUGIN_EPS
                }
                return _problems
            registered = {d.ep_name for d in ort.get_ep_devices()}
            for ep, package in PLUGIN_EPS.items():
                if ep in registered:
                    continue
                if importlib.util.find_spec(package) is None:
                    _problems[ep] = f"{package.replace('_', '-')} is not installed"
                    continue
                try:
                    path = importlib.import_module(package).get_library_path()
                    ort.register_execution_provider_library(ep, path)
                except Exception as e:  # a library that does not load here
                    _problems[ep] = f"{package} could not be registered: {e}"
                    logger.info("plugin EP %s: %s", ep, _problems[ep])
        return _problems


def plugin_problem(ep: str) -> str | None:
    """Why the plugin EP ``ep`` is not available, or None once it is registered."""
    return _register().get(ep, None)


def ep_devices() -> list[EpDevice]:
    """Every (EP, device) pair ONNX Runtime offers, plugin EPs registered first."""
    _register()
    ort = importlib.import_module("onnxruntime")
    found = []
    for d in ort.get_ep_devices():
        kind = str(d.device.type).rsplit(".", 1)[-1]
        found.append(
            EpDevice(
                ep=d.ep_name,
                ep_vendor=d.ep_vendor,
                device_type=kind,
                device_vendor=str(d.device.vendor),
                emulated=d.ep_name in PLUGIN_EPS and kind == "CPU",
                handle=d,
            )
        )
    return found

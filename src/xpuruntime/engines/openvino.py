"""OpenVINO engine: CPU, Intel GPU, NPU or AUTO, with the precision policy honoured."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, ClassVar

import numpy as np

from .._errors import (
    InvalidInputError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from ..kernels import Support
from ._cache import EngineCache
from ._engine import Engine, EngineContext

logger = logging.getLogger("xpuruntime.engines")

__all__ = ["OpenVinoEngine"]

# precision policy -> (INFERENCE_PRECISION_HINT, the capability the device must report)
_PRECISION = {"fp32": ("f32", None), "fp16": ("f16", "FP16"), "bf16": ("bf16", "BF16")}

_core = None
_core_lock = threading.Lock()


def _shared_core() -> Any:
    """One ov.Core per process: creating one loads every plugin and takes ~100 ms."""
    global _core
    with _core_lock:
        if _core is None:
            import openvino as ov

            _core = ov.Core()
        return _core


def _ov_device(ctx: EngineContext) -> str:
    device = ctx.device
    if device.kind == "auto":
        return "AUTO"
    if device.kind == "cpu":
        return "CPU"
    return f"{device.kind.upper()}.{device.index}" if device.kind == "gpu" else "NPU"


class OpenVinoEngine(Engine):
    """OpenVINO (``openvino``).

    Precision: ``fp32`` sets ``INFERENCE_PRECISION_HINT=f32`` (OpenVINO otherwise runs
    bf16 on CPUs with bf16 support, and f16 on GPUs); ``fp16``/``bf16`` set that hint and
    need the device to report the capability; ``default`` sets nothing. ``run`` is safe
    from several threads: each call borrows an infer request from a pool.
    """

    name = "openvino"
    library = "openvino"
    install_hint = "pip install xpuruntime[openvino]"
    device_kinds: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "npu", "auto")
    preference: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 0, "npu": 0, "auto": 0}

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        core = _shared_core()
        target = _ov_device(ctx)
        available = list(core.available_devices)
        if target != "AUTO" and _plugin_name(target, available) is None:
            return Support.no(f"OpenVINO does not see {target} (available: {available})")
        hint, capability = _PRECISION.get(ctx.policy.precision, (None, None))
        if capability is not None and target != "AUTO":
            caps = core.get_property(_plugin_name(target, available), "OPTIMIZATION_CAPABILITIES")
            if capability not in caps:
                return Support.no(
                    f"{target} does not support {ctx.policy.precision} (capabilities: {list(caps)})"
                )
        return Support.yes(f"{target}, precision hint {hint or 'device default'}")

    def _build(self, ctx: EngineContext) -> None:
        core = _shared_core()
        target = _ov_device(ctx)
        config: dict[str, Any] = {}
        hint = _PRECISION.get(ctx.policy.precision, (None, None))[0]
        if hint is not None:
            config["INFERENCE_PRECISION_HINT"] = hint
        if ctx.policy.threads is not None and target == "CPU":
            config["INFERENCE_NUM_THREADS"] = ctx.policy.threads
        self._compiled, cache_state = self._compile(core, target, config, ctx)
        self._output_index = {}
        for index, port in enumerate(self._compiled.outputs):
            for name in port.get_names():
                self._output_index.setdefault(name, index)
        missing = [s.name for s in ctx.model.outputs if s.name not in self._output_index]
        if missing:
            raise ModelLoadError(f"OpenVINO lost output name(s) {missing} while compiling")
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        import openvino as ov

        self._settings = {
            "version": ov.__version__,
            "device": target,
            "inference_precision": self._compiled.get_property(
                "INFERENCE_PRECISION_HINT"
            ).to_string()
            if target != "AUTO"
            else "chosen by AUTO",
            "execution_devices": list(self._compiled.get_property("EXECUTION_DEVICES")),
            "threads": ctx.policy.threads,
            "engine_cache": cache_state,
        }

    @staticmethod
    def _compile(
        core: Any, target: str, config: dict[str, Any], ctx: EngineContext
    ) -> tuple[Any, str]:
        """Compile, or import the compiled model from the engine cache (not for AUTO,
        whose choice of device happens at compile time)."""
        import openvino as ov

        def compile_it() -> Any:
            if ctx.model.path is not None:
                return core.compile_model(core.read_model(str(ctx.model.path)), target, config)
            return core.compile_model(core.read_model(ctx.model.data, b""), target, config)

        if target == "AUTO":
            return compile_it(), "not used (AUTO)"
        cache = EngineCache(ctx.policy.resolved_cache_dir / "engines")
        key = EngineCache.key(
            model=ctx.model.digest,
            engine="openvino",
            version=ov.__version__,
            device=target,
            device_name=core.get_property(target, "FULL_DEVICE_NAME"),
            config={k: str(v) for k, v in config.items()},
            shapes={k: list(v) for k, v in ctx.shapes.items()},
        )
        blob = cache.get(key)
        if blob is not None:
            try:
                return core.import_model(blob, target, config), f"hit {key[:12]}"
            except RuntimeError as e:  # same key, but this build cannot read it: rebuild
                logger.warning("OpenVINO could not import cached engine %s: %s", key[:12], e)
        compiled = compile_it()
        exported = compiled.export_model()  # a BytesIO in recent releases, bytes before
        data = exported.getvalue() if hasattr(exported, "getvalue") else bytes(exported)
        cache.put(key, data, {"engine": "openvino", "device": target})
        return compiled, f"stored {key[:12]}"

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            request.infer(feeds)
            # Copies: the request's output tensors are reused by its next inference.
            return [
                np.array(request.get_output_tensor(self._output_index[n]).data, copy=True)
                for n in output_names
            ]
        finally:
            self._requests.put(request)

    def close(self) -> None:
        self._compiled = None
        self._requests = queue.SimpleQueue()

    @classmethod
    def _translate(cls, error: Exception, action: str) -> XpuRuntimeError:
        text = f"openvino {action} failed: {str(error).strip()}"
        lowered = text.lower()
        if "out of memory" in lowered or "failed to allocate" in lowered:
            return OutOfMemoryError(text)
        if "not supported" in lowered or ("cannot create" in lowered and "layer" in lowered):
            return UnsupportedOperationError(text)
        if action == "run" and ("parametermismatch" in lowered or "shape" in lowered):
            return InvalidInputError(text)
        if action == "load":
            return ModelLoadError(text)
        return XpuRuntimeError(text)


def _plugin_name(target: str, available: list[str]) -> str | None:
    """The name OpenVINO lists ``target`` under (``GPU`` for ``GPU.0`` when alone)."""
    for name in available:
        if name == target or (target == "GPU.0" and name == "GPU"):
            return name
        if target in ("CPU", "NPU") and name.split(".")[0] == target:
            return name
    return None

"""ONNX Runtime engine: execution providers chosen from the device and the policy."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .._errors import (
    BackendUnavailableError,
    CudaError,
    InvalidInputError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from ..kernels import Support
from ._engine import Engine, EngineContext

__all__ = ["OnnxRuntimeEngine"]

_PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime (``onnxrt``).

    Providers: ``policy.providers`` if given, else ``cpu`` on the CPU and ``cuda`` on a
    CUDA device. On a CUDA device with precision ``fp32``, TF32 is turned off (ORT's CUDA
    EP uses it by default). In strict mode ORT's silent CPU fallback for nodes a GPU
    provider cannot run is disabled (``session.disable_cpu_ep_fallback``), so such a model
    fails to load instead. ``run`` is safe to call from several threads.
    """

    name = "onnxrt"
    library = "onnxruntime"
    install_hint = "pip install xpuruntime[onnxruntime] (or [onnxruntime-gpu] for CUDA)"
    device_kinds: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    preference: ClassVar[dict[str, int]] = {"cpu": 0, "cuda": 1}

    @classmethod
    def _providers(cls, ctx: EngineContext) -> tuple[str, ...]:
        if ctx.policy.providers is not None:
            return ctx.policy.providers
        return ("cuda",) if ctx.device.kind == "cuda" else ("cpu",)

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        if ctx.policy.precision in ("fp16", "bf16"):
            return Support.no(
                f"runs the model's own precision; precision={ctx.policy.precision} needs a "
                "model converted to that precision (or an engine with a precision hint)"
            )
        providers = cls._providers(ctx)
        gpu = [p for p in providers if p != "cpu"]
        if gpu and ctx.device.kind != "cuda":
            return Support.no(f"providers {list(gpu)} need a CUDA device, not {ctx.device}")
        if ctx.device.kind == "cuda" and not gpu:
            return Support.no(f"providers {list(providers)} do not run on {ctx.device}")
        available = cls.require().get_available_providers()
        for p in providers:
            if _PROVIDER_NAMES[p] not in available:
                return Support.unavailable(
                    f"onnxruntime {cls.version()} has no {_PROVIDER_NAMES[p]} "
                    f"(available: {', '.join(available)}); install onnxruntime-gpu"
                )
        if ctx.device.kind == "cuda" and not ctx.device.exists:
            return Support.no(f"{ctx.device} was not found by device discovery")
        return Support.yes(f"providers {', '.join(_PROVIDER_NAMES[p] for p in providers)}")

    def _provider_options(self, provider: str, ctx: EngineContext) -> dict[str, Any]:
        if provider == "cuda":
            return {
                "device_id": ctx.device.index,
                "use_tf32": 0 if ctx.policy.precision == "fp32" else 1,
            }
        if provider == "tensorrt":
            cache = ctx.policy.resolved_cache_dir / "tensorrt"
            return {
                "device_id": ctx.device.index,
                "trt_fp16_enable": False,
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": str(cache),
                "trt_timing_cache_enable": True,
                "trt_timing_cache_path": str(cache),
            }
        return {}

    def _build(self, ctx: EngineContext) -> None:
        ort = self.require()
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _LEVELS[ctx.policy.optimization_level]
        )
        # Fatal only: ORT's errors reach the caller as exceptions; its prints are noise.
        options.log_severity_level = 4
        if ctx.policy.threads is not None:
            options.intra_op_num_threads = ctx.policy.threads
        providers = self._providers(ctx)
        if ctx.policy.strict and "cpu" not in providers:
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        wanted = [(_PROVIDER_NAMES[p], self._provider_options(p, ctx)) for p in providers]
        if "cpu" not in providers and not ctx.policy.strict:
            wanted.append(("CPUExecutionProvider", {}))
        source = str(ctx.model.path) if ctx.model.path else ctx.model.data
        self._session = ort.InferenceSession(source, sess_options=options, providers=wanted)
        active = self._session.get_providers()
        dropped = [name for name, _ in wanted if name not in active]
        if dropped:
            # ORT drops a provider whose libraries fail to load and carries on: not for us.
            raise BackendUnavailableError(
                f"onnxruntime could not start {', '.join(dropped)} (active: {active}); "
                "its CUDA/cuDNN/TensorRT libraries are missing or do not match"
            )
        self._settings = {
            "version": ort.__version__,
            "providers": active,
            "optimization_level": ctx.policy.optimization_level,
            "intra_op_threads": ctx.policy.threads,
            "cpu_fallback": "n/a"
            if "cpu" in providers
            else ("disabled (strict)" if ctx.policy.strict else "allowed"),
        }
        if ctx.device.kind == "cuda":
            self._settings["tf32"] = ctx.policy.precision != "fp32"

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        return self._session.run(output_names, feeds)

    def close(self) -> None:
        self._session = None

    @classmethod
    def _translate(cls, error: Exception, action: str) -> XpuRuntimeError:
        text = f"onnxruntime {action} failed: {error}"
        kind = type(error).__name__
        lowered = str(error).lower()
        if "failed to allocate memory" in lowered or "out of memory" in lowered:
            return OutOfMemoryError(text)
        if "cuda failure" in lowered or "cuda error" in lowered:
            return CudaError(text)
        if kind == "NotImplemented":
            return UnsupportedOperationError(text)
        if action == "run" and kind == "InvalidArgument":
            return InvalidInputError(text)
        if action == "load":
            return ModelLoadError(text)
        return XpuRuntimeError(text)

"""TensorRT engine, through ONNX Runtime's TensorRT execution provider.

Needs onnxruntime-gpu with ``TensorrtExecutionProvider`` and TensorRT's own libraries
(``libnvinfer``) where the dynamic loader finds them. Engines and timing caches go to
``<cache_dir>/tensorrt``. Without either, selection says exactly what is missing and
strict mode raises :class:`~xpuruntime.BackendUnavailableError`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import ClassVar

from ..kernels import Support
from ._engine import EngineContext
from .onnxrt import OnnxRuntimeEngine

__all__ = ["TensorRTEngine"]

_NVINFER = ("libnvinfer.so.10", "libnvinfer.so.11", "nvinfer_10.dll", "nvinfer_11.dll")


def _nvinfer_loadable() -> str | None:
    for name in _NVINFER:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


class TensorRTEngine(OnnxRuntimeEngine):
    """TensorRT via ONNX Runtime (``tensorrt``), with CUDA EP for unsupported nodes."""

    name = "tensorrt"
    install_hint = "pip install xpuruntime[tensorrt] (onnxruntime-gpu and tensorrt)"
    device_kinds: ClassVar[tuple[str, ...]] = ("cuda",)
    preference: ClassVar[dict[str, int]] = {"cuda": 0}

    @classmethod
    def _with_trt(cls, ctx: EngineContext) -> EngineContext:
        policy = ctx.policy
        if policy.providers is None or "tensorrt" not in policy.providers:
            policy = policy.replace(providers=("tensorrt", "cuda"))
        return dataclasses.replace(ctx, policy=policy)

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        library = _nvinfer_loadable()
        if library is None:
            return Support.unavailable(
                f"TensorRT's library ({' or '.join(_NVINFER[:2])}) cannot be loaded: "
                f"{cls.install_hint}"
            )
        return super()._supports(cls._with_trt(ctx))

    def _build(self, ctx: EngineContext) -> None:
        super()._build(self._with_trt(ctx))
        self._settings["nvinfer"] = _nvinfer_loadable()

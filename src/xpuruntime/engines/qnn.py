"""Qualcomm NPU engine, through ONNX Runtime's QNN execution provider (onnxruntime-qnn).

The QNN EP exists in the onnxruntime-qnn builds for Windows on Snapdragon (and Android);
its HTP backend library (``QnnHtp``) runs the model on the Hexagon NPU.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from .._errors import BackendUnavailableError
from ..kernels import Support
from ._engine import EngineContext
from .onnxrt import OnnxRuntimeEngine

__all__ = ["QnnEngine"]

_BACKEND = "QnnHtp.dll" if sys.platform == "win32" else "libQnnHtp.so"


class QnnEngine(OnnxRuntimeEngine):
    """ONNX Runtime with ``QNNExecutionProvider`` on the HTP backend (``qnn``)."""

    name = "qnn"
    install_hint = "pip install onnxruntime-qnn (Windows on Snapdragon or Android)"
    device_kinds: ClassVar[tuple[str, ...]] = ("npu",)
    preference: ClassVar[dict[str, int]] = {"npu": 1}

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        available = cls.require().get_available_providers()
        if "QNNExecutionProvider" not in available:
            return Support.unavailable(
                f"onnxruntime {cls.version()} has no QNNExecutionProvider "
                f"(available: {', '.join(available)}): {cls.install_hint}"
            )
        return Support.yes(f"QNNExecutionProvider with {_BACKEND}")

    def _build(self, ctx: EngineContext) -> None:
        ort = self.require()
        options = ort.SessionOptions()
        options.log_severity_level = 4
        # The NPU runs what it can; the rest would silently go to the CPU without this.
        options.add_session_config_entry(
            "session.disable_cpu_ep_fallback", "1" if ctx.policy.strict else "0"
        )
        source = str(ctx.model.path) if ctx.model.path else ctx.model.data
        providers: list[Any] = [("QNNExecutionProvider", {"backend_path": _BACKEND})]
        if not ctx.policy.strict:
            providers.append("CPUExecutionProvider")
        self._session = ort.InferenceSession(source, sess_options=options, providers=providers)
        self._run_feeds = self._session.run
        if "QNNExecutionProvider" not in self._session.get_providers():
            raise BackendUnavailableError(f"onnxruntime could not start QNN with {_BACKEND}")
        self._settings = {"providers": self._session.get_providers(), "backend": _BACKEND}

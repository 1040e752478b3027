"""Qualcomm NPU engine: ONNX Runtime's QNN execution provider on the HTP backend.

onnxruntime-qnn (>= 2.7) is a plugin EP: its library is registered with ONNX Runtime
(``register_execution_provider_library``) and a session is given its EP devices
(``SessionOptions.add_provider_for_devices``). The older ``providers=[("QNNExecution
Provider", ...)]`` form does not reach it: with CPU fallback allowed every node then
runs on the CPU EP while ``get_providers()`` still lists QNN. Only the HTP backend is in
the wheel. On a Snapdragon, ORT reports the EP device as an NPU; on Linux x86_64 the
same backend runs in Qualcomm's emulation on the host CPU, and ORT reports a CPU device:
such a session says so (``emulation``), never that it ran on an NPU.

Which nodes QNN took is recorded at load (:class:`~xpuruntime.engines.Placement`).
The compiled QNN context (an EPContext model with the context binary embedded) is kept
in the engine cache, so a later session skips QNN's graph compilation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .._errors import BackendUnavailableError, PolicyError
from ..kernels import Support
from ..runtime._ort_plugins import ep_devices, plugin_problem
from ._cache import EngineCache, admit
from ._engine import EngineContext
from ._int8 import calibration_digest, quiet
from ._placement import RECORD_PLACEMENT
from .onnxrt import OnnxRuntimeEngine, onnxruntime

__all__ = ["QnnEngine", "qnn_devices"]

logger = logging.getLogger("xpuruntime.engines")

EP_NAME = "QNNExecutionProvider"
_PROVIDER_OPTIONS = {"backend_type": "htp"}


def qnn_devices() -> list[Any]:
    """ONNX Runtime's EP devices of the QNN EP (its library registered once).

    Raises
    ------
    BackendUnavailableError
        onnxruntime-qnn is missing, or its library does not load here.
    """
    if importlib.util.find_spec("onnxruntime_qnn") is None:
        raise BackendUnavailableError(f"onnxruntime-qnn is not installed: {QnnEngine.install_hint}")
    problem = plugin_problem(EP_NAME)
    if problem is not None:
        raise BackendUnavailableError(
            f"{problem}; onnxruntime-qnn needs glibc >= 2.35 on Linux ({QnnEngine.install_hint})"
        )
    return [d.handle for d in ep_devices() if d.ep == EP_NAME]


def is_emulated(devices: list[Any]) -> bool:
    """Whether the QNN devices ORT reports are the host CPU (HTP emulation on x86_64)."""
    npu = onnxruntime().OrtHardwareDeviceType.NPU
    return not any(d.device.type == npu for d in devices)


class QnnEngine(OnnxRuntimeEngine):
    """ONNX Runtime with the QNN execution provider on the HTP backend (``qnn``).

    Precision: ``fp32`` runs the model as given (HTP computes float ops in FP16: the
    accuracy gate is how a user sees what that changed); ``int8`` quantizes it to QDQ
    with onnxruntime's own QNN quantization config on the session's
    ``calibration_inputs`` (cached), and the accuracy gate then compares with ONNX
    Runtime on the CPU running the same QDQ model, within one output quantization
    step; ``default`` is ``fp32``.
    """

    name = "qnn"
    library = "onnxruntime_qnn"
    install_hint = (
        "pip install xpuruntime[qnn] (onnxruntime-qnn: Windows on Snapdragon, or Linux "
        "x86_64 with glibc >= 2.35, where the HTP backend runs in emulation)"
    )
    device_kinds: ClassVar[tuple[str, ...]] = ("npu",)
    preference: ClassVar[dict[str, int]] = {"npu": 1}

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        if ctx.policy.precision not in ("fp32", "int8", "default"):
            return Support.no(
                f"runs fp32 models (computed in FP16 on HTP) or int8 QDQ models, not "
                f"precision={ctx.policy.precision}"
            )
        if ctx.policy.precision == "int8" and not ctx.calibration_inputs:
            return Support.no("precision int8 needs calibration_inputs to quantize with")
        unfixed = _unfixed_dims(ctx)
        if unfixed:
            return Support.no(
                f"QNN compiles fixed shapes; {', '.join(unfixed)} are dynamic: pass "
                "sample_inputs to fix them"
            )
        try:
            devices = qnn_devices()
        except BackendUnavailableError as e:
            return Support.unavailable(str(e))
        if not devices:
            return Support.unavailable(
                f"onnxruntime-qnn {cls.version()} registered no QNN device here"
            )
        where = "HTP emulation on the host CPU (not an NPU)" if is_emulated(devices) else "NPU"
        return Support.yes(f"QNN HTP backend, {where}")

    def _build(self, ctx: EngineContext) -> None:
        ort = onnxruntime()
        devices = qnn_devices()
        self._graph = self._stream = None
        self._kernel_rows = []
        self._emulated = is_emulated(devices)
        self._step: float | None = None
        if ctx.policy.precision == "int8":
            # A QDQ model's first QuantizeLinear and last DequantizeLinear convert the
            # caller's float I/O; ORT runs them on the CPU EP by design.
            source, self._step, boundary = _static_qdq(self._quantized(ctx), ctx)
            digest = hashlib.sha256(source).hexdigest()
        else:
            source, digest, boundary = (
                _with_static_inputs(ctx.model.data, ctx),
                ctx.model.digest,
                frozenset(),
            )
        self._executed = source
        session, cache_state = self._load(ort, devices, source, digest, ctx)
        self._adopt(session, ctx)
        import onnxruntime_qnn

        self._settings = {
            "version": f"onnxruntime {ort.__version__}, onnxruntime-qnn {self.version()}",
            "backend": "htp",
            "device": "HTP emulation on the host CPU (x86_64), not an NPU"
            if self._emulated
            else "Qualcomm NPU (HTP)",
            "library": Path(onnxruntime_qnn.get_library_path()).name,
            "precision": "int8 (QDQ, quantized here)"
            if self._step is not None
            else "fp32 model (HTP computes in FP16)",
            "cpu_fallback": "none allowed (strict)" if ctx.policy.strict else "allowed, reported",
            "engine_cache": cache_state,
        }
        self._check_placement(ctx, EP_NAME, allowed_nodes=boundary)

    # -- loading through the engine cache ----------------------------------------------------
    def _options(self, ort: Any, devices: list[Any], ctx: EngineContext) -> Any:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.add_session_config_entry(RECORD_PLACEMENT, "1")
        # Nodes QNN cannot take go to the CPU EP; the placement check that follows the
        # load makes that an error naming them under a strict policy (ORT's own
        # disable_cpu_ep_fallback refuses without saying which), and a warning otherwise.
        if ctx.policy.threads is not None:
            options.intra_op_num_threads = ctx.policy.threads
        if ctx.model.path is not None:  # external data of a model given as bytes
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(ctx.model.path.parent)
            )
        options.add_provider_for_devices(devices, dict(_PROVIDER_OPTIONS))
        return options

    def _load(
        self, ort: Any, devices: list[Any], source: bytes, digest: str, ctx: EngineContext
    ) -> tuple[Any, str]:
        """A session, from a cached QNN context when there is a good one; a new context
        is stored only if a session loaded from it reproduces the compiled one."""
        cache = ctx.engine_cache
        key = EngineCache.key(
            format=2,
            model=digest,
            engine="qnn",
            onnxruntime=ort.__version__,
            qnn=self.version(),
            emulated=self._emulated,
            strict=ctx.policy.strict,
            shapes={  # the shapes the dynamic inputs were fixed to
                s.name: list(ctx.shapes[s.name])
                for s in ctx.model.inputs
                if s.is_dynamic and s.name in ctx.shapes
            },
            options=_PROVIDER_OPTIONS,
        )
        problem = cache.problem
        blob = cache.get(key) if problem is None else None
        if blob is not None:
            try:
                return ort.InferenceSession(
                    blob, self._options(ort, devices, ctx)
                ), f"hit {key[:12]}"
            except Exception as e:  # same key, but this build cannot read it: rebuild
                logger.warning("QNN could not load cached context %s: %s", key[:12], e)
        with tempfile.TemporaryDirectory(prefix="xrt-qnn-") as scratch:
            context_path = Path(scratch) / "model_ctx.onnx"
            options = self._options(ort, devices, ctx)
            if problem is None:
                options.add_session_config_entry("ep.context_enable", "1")
                options.add_session_config_entry("ep.context_embed_mode", "1")
                options.add_session_config_entry("ep.context_file_path", str(context_path))
            session = ort.InferenceSession(source, options)
            if problem is not None:
                return session, f"not used: {problem}"
            if not context_path.exists():
                return session, "not stored: QNN wrote no context (no node on QNN)"
            context = context_path.read_bytes()
        state = admit(
            cache,
            key,
            context,
            {"engine": "qnn"},
            ctx.samples,
            lambda feeds: session.run(None, feeds),
            lambda feeds: ort.InferenceSession(context, self._options(ort, devices, ctx)).run(
                None, feeds
            ),
        )
        return session, state

    # -- int8 --------------------------------------------------------------------------------
    def _quantized(self, ctx: EngineContext) -> bytes:
        """The model quantized to QDQ for QNN on the calibration inputs (cached)."""
        calibration = ctx.calibration_inputs or []
        cache = ctx.engine_cache
        key = EngineCache.key(
            format=2,
            model=ctx.model.digest,
            engine="qnn-qdq",
            onnxruntime=onnxruntime().__version__,
            calibration=calibration_digest(calibration),
        )
        model = cache.get(key) if cache.problem is None else None
        if model is None:
            model = _quantize_for_qnn(ctx, calibration)
            cache.put(key, model, {"engine": "qnn-qdq"})
        return model

    @property
    def reference_model(self) -> bytes | None:
        """The QDQ model an int8 session runs: its accuracy is judged against ONNX
        Runtime on the CPU running that same model."""
        return self._executed if self._step is not None else None

    def accuracy_tolerance(self, rtol: float, atol: float) -> tuple[float, float, str]:
        if self._step is None:
            return rtol, atol, ""
        # One output quantization step (plus float rounding): what HTP and the CPU EP
        # may differ by on the same QDQ model.
        return 0.0, self._step * 1.001, f"one output quantization step ({self._step:.3g})"


def _unfixed_dims(ctx: EngineContext) -> list[str]:
    """Dynamic input dimensions that the sample inputs do not fix."""
    unfixed = []
    for spec in ctx.model.inputs:
        if spec.name in ctx.shapes:
            continue
        if spec.shape is None:
            unfixed.append(f"{spec.name} (no declared rank)")
            continue
        for axis, dim in enumerate(spec.shape):
            if not isinstance(dim, int):
                unfixed.append(f"{spec.name}[{axis}]" + (f" ({dim!r})" if dim else ""))
    return unfixed


def _with_static_inputs(source: bytes, ctx: EngineContext) -> bytes:
    """``source`` with every dynamic input dimension set from the sample inputs' shapes
    (QNN compiles static graphs; named and unnamed dimensions alike)."""
    if not _dynamic_with_shapes(ctx):
        return source
    import onnx

    proto = onnx.load_from_string(source)
    _fix_input_dims(proto, ctx)
    return proto.SerializeToString()


def _static_qdq(model: bytes, ctx: EngineContext) -> tuple[bytes, float, frozenset[str]]:
    """A QDQ model with static inputs (:func:`_with_static_inputs`), the largest
    quantization step of its outputs, and the names of the nodes converting its float
    I/O (QuantizeLinear on graph inputs, DequantizeLinear on graph outputs): one parse."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_from_string(model)
    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    steps, boundary = [], set()
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in inputs:
            boundary.add(node.name)
        elif node.op_type == "DequantizeLinear" and node.output[0] in outputs:
            boundary.add(node.name)
            scale = initializers.get(node.input[1])
            if scale is not None:
                steps.append(float(np.max(numpy_helper.to_array(scale))))
    if not steps:
        raise PolicyError(
            "precision int8: the quantized model's outputs are not dequantized from QDQ; "
            "cannot state its quantization step"
        )
    if _dynamic_with_shapes(ctx):
        _fix_input_dims(proto, ctx)
        model = proto.SerializeToString()
    return model, max(steps), frozenset(boundary)


def _dynamic_with_shapes(ctx: EngineContext) -> set[str]:
    return {s.name for s in ctx.model.inputs if s.is_dynamic and s.name in ctx.shapes}


def _fix_input_dims(proto: Any, ctx: EngineContext) -> None:
    dynamic = _dynamic_with_shapes(ctx)
    for value in proto.graph.input:
        if value.name in dynamic:
            for dim, size in zip(value.type.tensor_type.shape.dim, ctx.shapes[value.name]):
                dim.dim_value = int(size)  # clears dim_param: the two share a oneof


def _quantize_for_qnn(ctx: EngineContext, calibration: list[dict[str, np.ndarray]]) -> bytes:
    from onnxruntime.quantization import CalibrationDataReader, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._feeds, None)

    with tempfile.TemporaryDirectory(prefix="xrt-qdq-") as scratch:
        source = Path(scratch) / "model.onnx"
        target = Path(scratch) / "model.qdq.onnx"
        if ctx.model.path is not None:
            source = ctx.model.path
        else:
            source.write_bytes(ctx.model.data)
        with quiet():  # onnxruntime.quantization's pre-processing advice
            config = get_qnn_qdq_config(str(source), Reader())
            quantize(str(source), str(target), config)
        return target.read_bytes()

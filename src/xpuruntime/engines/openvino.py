"""OpenVINO engine: CPU, Intel GPU, NPU or AUTO, with the precision policy honoured."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib.util
import logging
import queue
import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .._errors import (
    ExecutionError,
    InvalidInputError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from ..kernels import Support
from ._cache import EngineCache, admit
from ._dtypes import exotic_io, from_raw, to_raw
from ._engine import Engine, EngineContext
from ._int8 import (
    CandidateJudge,
    Int8Plan,
    Int8Verdict,
    QdqTypes,
    quantized_openvino,
    quantized_qdq,
    race,
    searched_qdq,
)
from ._static_shapes import StaticShapes, shapes_key

logger = logging.getLogger("xpuruntime.engines")

__all__ = ["OpenVinoEngine"]

# precision policy -> (INFERENCE_PRECISION_HINT, the capability the device must report).
# int8 and auto compile their fp32 models (the fallback, auto's other candidate) and the
# layers left unquantized in f32 too: without the hint OpenVINO's CPU plugin computes
# them in bf16 on CPUs with AVX512_BF16 or AMX (most servers), below the reported precision.
_PRECISION = {
    "fp32": ("f32", None),
    "fp16": ("f16", "FP16"),
    "bf16": ("bf16", "BF16"),
    "int8": ("f32", None),
    "auto": ("f32", None),
}

# How an int8 model whose unquantized layers compute in bf16 says so.
_BF16_REST = "; unquantized layers in bf16"

# Compiled forms for the input shapes run (see _static_shapes): at most this many,
# and this many bytes of model in all.
_STATIC_SHAPES = 8
_STATIC_BYTES = 1 << 30
# Input shapes of a dynamic model that OpenVINO's shape inference accepted, kept (the
# check costs 4-14 ms on the PP-OCR models); past this many the set starts again. The
# check keeps a copy of the model (its weights too): not for a model over this size.
_SHAPES_KEPT = 4096
_SHAPE_CHECK_BYTES = 256 << 20

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
    need the device to report the capability; ``int8`` and ``auto`` quantize with NNCF
    (see :mod:`~xpuruntime.engines._int8`; without NNCF, with ONNX Runtime's quantizer),
    and where that model misses the gate run the QDQ model that ONNX Runtime's quantizer
    makes with the fewest compute nodes in fp32 that passes when OpenVINO runs it; they
    set ``f32`` for what stays unquantized and for their fp32 models; ``default`` sets
    nothing. Performance:
    ``PERFORMANCE_HINT`` from the policy, and as many requests as OpenVINO says keep the
    device busy (``OPTIMAL_NUMBER_OF_INFER_REQUESTS``). ``run`` is safe from several
    threads: each call borrows an infer request from a pool.
    """

    name = "openvino"
    library = "openvino"
    install_hint = "pip install xpuruntime[openvino]"
    device_kinds: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "npu", "auto")
    preference: ClassVar[dict[str, int]] = {"cpu": 1, "gpu": 0, "npu": 0, "auto": 0}
    unquantized_precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16")

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        core = _shared_core()
        target = _ov_device(ctx)
        available = list(core.available_devices)
        if target != "AUTO" and _plugin_name(target, available) is None:
            return Support.no(f"OpenVINO does not see {target} (available: {available})")
        if ctx.policy.precision in ("int8", "auto"):
            if ctx.policy.precision == "int8" and not ctx.calibration_inputs:
                return Support.no("precision int8 needs calibration_inputs to quantize with")
            if ctx.calibration_inputs and importlib.util.find_spec("onnxruntime") is None:
                return Support.unavailable(
                    f"precision {ctx.policy.precision} on OpenVINO judges the int8 model "
                    "against ONNX Runtime's fp32 run and searches ONNX Runtime's QDQ "
                    "models; onnxruntime is not installed (pip install "
                    "xpuruntime[onnxruntime])"
                )
            if ctx.policy.unquantized_precision == "bf16":
                caps = (
                    []
                    if target == "AUTO"
                    else core.get_property(
                        _plugin_name(target, available), "OPTIMIZATION_CAPABILITIES"
                    )
                )
                if "BF16" not in caps:
                    return Support.no(
                        f"unquantized_precision=bf16 needs a device that reports BF16; "
                        f"{target} reports {list(caps)}"
                    )
            if importlib.util.find_spec("nncf") is not None:
                return Support.yes(f"{target}, int8 by NNCF from calibration_inputs")
            return Support.yes(
                f"{target}, int8 by ONNX Runtime's quantizer from calibration_inputs "
                "(NNCF is not installed)"
            )
        hint, capability = _PRECISION.get(ctx.policy.precision, (None, None))
        if capability is not None and target != "AUTO":
            caps = core.get_property(_plugin_name(target, available), "OPTIMIZATION_CAPABILITIES")
            if capability not in caps:
                return Support.no(
                    f"{target} does not support {ctx.policy.precision} (capabilities: {list(caps)})"
                )
        return Support.yes(f"{target}, precision hint {hint or 'device default'}")

    @staticmethod
    def _compile_config(ctx: EngineContext, target: str) -> dict[str, Any]:
        """The compile config of the model as the policy asks for it."""
        config: dict[str, Any] = {}
        hint = _PRECISION.get(ctx.policy.precision, (None, None))[0]
        if hint is not None:
            config["INFERENCE_PRECISION_HINT"] = hint
        if ctx.policy.threads is not None and target == "CPU":
            config["INFERENCE_NUM_THREADS"] = ctx.policy.threads
        config["PERFORMANCE_HINT"] = ctx.policy.performance.upper()
        return config

    @classmethod
    def _thread_runner(cls, ctx: EngineContext) -> Callable[[int | None], Callable[[], Any]]:
        prepared: list[tuple[Any, dict[str, np.ndarray]]] = []  # read once, compiled per count

        def runner(threads: int | None) -> Callable[[], Any]:
            import openvino as ov

            core = _shared_core()
            if not prepared:
                model = cls._read(core, ctx)
                names = {name for port in model.inputs for name in port.get_names()}
                # Copies of its own, shared with the request: timed as the engine runs it.
                feeds = {k: np.array(v) for k, v in ctx.samples().items() if k in names}
                if any(port.get_partial_shape().is_dynamic for port in model.inputs):
                    # As static shapes compile it; OpenVINO's shape inference refuses
                    # shapes the model cannot take before its CPU plugin runs them.
                    model.reshape({k: ov.PartialShape(list(v.shape)) for k, v in feeds.items()})
                prepared.append((model, feeds))
            model, feeds = prepared[0]
            counted = dataclasses.replace(ctx, policy=ctx.policy.replace(threads=threads))
            config = cls._compile_config(counted, "CPU")
            request = core.compile_model(model, "CPU", config).create_infer_request()
            return lambda: request.infer(feeds, share_inputs=True, share_outputs=True)

        return runner

    def _build(self, ctx: EngineContext) -> None:
        core = _shared_core()
        target = _ov_device(ctx)
        config = self._compile_config(ctx, target)
        self._target, self._config = target, config
        # The int8 form's: what it leaves unquantized computes in the policy's precision.
        bf16_rest = ctx.policy.unquantized_precision == "bf16"
        self._int8_config = {**config, "INFERENCE_PRECISION_HINT": "bf16"} if bf16_rest else config
        self._rest = _BF16_REST if bf16_rest else ""  # what the int8 method's line adds
        self._rebuild_lock = threading.Lock()
        self._int8: _Int8Form | None = None  # set while the int8 model runs
        self._nncf_model: Any = None  # NNCF's int8 model, quantized here, while it runs
        self._nncf_ir: str | None = None  # its key in the engine cache
        # Every run of the model (the int8 judges' and the engine cache's too) has its
        # input shapes checked first, while they can be dynamic; not a model so large
        # that a second copy of it in memory costs more than the check protects.
        checked = ctx.model.nbytes <= _SHAPE_CHECK_BYTES
        self._shapes = _ShapeCheck(lambda: self._read(core, ctx)) if checked else None
        compiled, cache_state, precision = self._with_precision(core, ctx)
        if self._int8 is None or self._int8.qdq is not None:
            self._nncf_model = None
        self._state: _Compiled | None = _Compiled(compiled)  # None: compile at next use
        self._static, static_note = self._static_shapes(ctx, compiled)
        # A model of fixed input shapes runs a batch of joined requests on a form
        # compiled for the batch's shapes (OpenVINO's reshape), one or two at a time.
        fixed = not any(port.get_partial_shape().is_dynamic for port in compiled.inputs)
        self._batches = StaticShapes(self._compile_static, 2) if fixed else None
        if fixed:
            self._shapes = None
        streams = compiled.get_property("NUM_STREAMS") if target == "CPU" else None
        self._streams_note = "" if streams is None else f", {streams} stream(s)"
        self._output_index = {}
        for index, port in enumerate(compiled.outputs):
            for name in port.get_names():
                self._output_index.setdefault(name, index)
        missing = [s.name for s in ctx.model.outputs if s.name not in self._output_index]
        if missing:
            raise ModelLoadError(f"OpenVINO lost output name(s) {missing} while compiling")
        # OpenVINO removes graph inputs no computation reads: such an input is still
        # validated against the ONNX declaration, then not fed.
        ports = {}
        for index, port in enumerate(compiled.inputs):
            for name in port.get_names():
                ports.setdefault(name, index)
        self._input_index = {s.name: ports[s.name] for s in ctx.model.inputs if s.name in ports}
        if self._static is not None and ctx.sample_inputs is not None:
            # The sample inputs' shape is compiled for now, not in the first request.
            self._static.get(shapes_key(ctx.sample_inputs, self._input_index))
        dropped = [s.name for s in ctx.model.inputs if s.name not in ports]
        self._exotic = exotic_io((*ctx.model.inputs, *ctx.model.outputs))
        import openvino as ov

        self._settings = {
            "version": ov.__version__,
            "device": target,
            "inference_precision": compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
            if target != "AUTO"
            else "chosen by AUTO",
            "execution_devices": list(compiled.get_property("EXECUTION_DEVICES")),
            "threads": ctx.policy.threads,
            "precision": precision,
            "performance": None,  # the settings property's: static forms can add requests
            "engine_cache": cache_state,
            "unused_inputs": dropped or None,
            "static_shapes": static_note,
            "int8_layers": None if self._int8 is None else _int8_layers(compiled),
        }

    def _static_shapes(self, ctx: EngineContext, compiled: Any) -> tuple[StaticShapes | None, str]:
        """The compiled forms for the input shapes run, or None, and why not."""
        if not any(port.get_partial_shape().is_dynamic for port in compiled.inputs):
            return None, "not needed (the inputs' shapes are fixed)"
        if not ctx.policy.static_shapes:
            return None, "off (policy static_shapes=False)"
        if self._target != "CPU":
            return None, f"not used on {self._target} (measured on the CPU only)"
        limit = min(_STATIC_SHAPES, _STATIC_BYTES // max(1, ctx.model.nbytes))
        if limit == 0:
            return None, f"not used (the model is over {_STATIC_BYTES >> 20} MiB)"
        return StaticShapes(self._compile_static, limit), f"for each input shape, up to {limit}"

    def _compile_static(self, shapes: dict[str, tuple[int, ...]]) -> _Compiled:
        """The running model (fp32, or its int8 form) compiled for ``shapes``."""
        import openvino as ov

        core = _shared_core()
        form = self._int8
        if form is None:
            model = self._read(core, self._ctx)
        elif form.qdq is not None:
            model = core.read_model(form.qdq, b"")
        else:
            if self._nncf_model is None:  # compiled from the engine cache: its IR beside it
                self._nncf_model = _read_ir(core, self._ctx.engine_cache.get(self._nncf_ir))
            model = self._nncf_model.clone()  # reshape changes the model it is given
        model.reshape({name: ov.PartialShape(list(shape)) for name, shape in shapes.items()})
        compiled = core.compile_model(model, self._target, self._config_for(form))
        # OpenVINO sizes a static model's streams from its shapes (a dynamic one gets a
        # default): PP-OCRv4 rec on 16 cores, 4 streams dynamic, more static. The most
        # requests any form keeps busy is what the session runs at once.
        optimal = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        self._requests = max(self._requests, optimal)
        return _Compiled(compiled, int(compiled.get_property("NUM_STREAMS")))

    @property
    def settings(self) -> dict[str, Any]:
        settings = super().settings
        if "performance" in settings:  # built
            settings["performance"] = (
                f"{self._ctx.policy.performance}: {self._requests} infer request(s)"
                + self._streams_note
            )
        forms = [] if getattr(self, "_static", None) is None else self._static.forms
        if forms:
            shown = ", ".join(
                _shapes_shown(shapes) + f" ({compiled.streams} stream(s))"
                for shapes, compiled in forms
            )
            settings["static_shapes"] += f"; compiled for {shown}"
        batches = [] if getattr(self, "_batches", None) is None else self._batches.forms
        if batches:
            settings["joined_batches"] = "compiled for " + ", ".join(
                _shapes_shown(shapes) + f" ({compiled.streams} stream(s))"
                for shapes, compiled in batches
            )
        return settings

    def _with_precision(self, core: Any, ctx: EngineContext) -> tuple[Any, str, str | None]:
        """The compiled model to run, its cache state and its precision line: under
        ``int8`` the int8 model if it passes the gate (NNCF's, else the searched QDQ
        model), under ``auto`` the faster of it and the fp32 model that passes; else the
        model as given."""
        precision = ctx.policy.precision
        if precision not in ("int8", "auto"):
            compiled, state = self._compile(core, ctx)
        elif not ctx.calibration_inputs:
            compiled, state = self._compile(core, ctx)
            precision = "fp32 (auto: int8 not tried, no calibration_inputs)"
        else:
            plan = Int8Plan(ctx)
            if importlib.util.find_spec("nncf") is not None:
                form = _Int8Form(plan)
            else:  # ONNX Runtime's quantizer: its QDQ model, which OpenVINO runs in int8
                form = _Int8Form(plan, *quantized_qdq(ctx, plan, QdqTypes.where(ctx, self.name)))
            int8: Any = None
            try:
                int8, int8_state = self._compile(core, ctx, form)
            except RuntimeError as e:  # OpenVINO cannot compile this one: a miss
                verdict = plan.unrunnable(form.method + self._rest, e)
            else:
                verdict = plan.judge(
                    lambda feeds: self._infer_all(int8, feeds), self._method + self._rest
                )
            if not verdict.passed:
                found = self._searched(core, ctx, plan, verdict)
                if found is not None:
                    form, int8, int8_state, verdict = found
                else:
                    none = "; searched ONNX Runtime's QDQ models run by OpenVINO: none passed"
                    verdict = dataclasses.replace(verdict, method=verdict.method + none)
            self._judged = verdict.describe()
            if precision == "int8" and plan.settle(verdict, self.name):
                self._int8, compiled, state, precision = form, int8, int8_state, self._judged
            elif precision == "int8":
                compiled, state = self._compile(core, ctx)
                precision = f"fp32 (int8 fell back: {self._judged})"
            elif int8 is None:
                compiled, state = self._compile(core, ctx)
                precision = f"fp32 (auto: {self._judged})"
            else:
                fp32, state = self._compile(core, ctx)
                chosen, precision = race(
                    plan,
                    verdict,
                    lambda feeds: self._infer_all(fp32, feeds),
                    lambda feeds: self._infer_all(int8, feeds),
                )
                compiled = fp32
                if chosen == "int8":
                    self._int8, compiled, state = form, int8, int8_state
        self._requests = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        return compiled, state, None if precision == ctx.policy.precision else precision

    def _searched(
        self, core: Any, ctx: EngineContext, plan: Int8Plan, missed: Int8Verdict
    ) -> tuple[_Int8Form, Any, str, Int8Verdict] | None:
        """The first int8 model (NNCF's, or without NNCF ONNX Runtime's QDQ model quantized
        whole) ``missed`` the gate: the QDQ model of ONNX Runtime's quantizer with the
        fewest compute nodes in fp32 that passes when OpenVINO runs it
        (:func:`~xpuruntime.engines._int8.searched_qdq`, every candidate compiled here and
        judged; one OpenVINO cannot compile is a miss), as its form, compiled model, cache
        state and verdict; or None.

        OpenVINO runs QDQ models in int8 as it runs NNCF's; NNCF's ignored scope cannot
        stand in: on PP-OCRv4 det no choice of up to half its convolutions left out
        passed where ONNX Runtime's ranked nodes in fp32 do.
        """
        target, config = self._target, self._int8_config
        judge = CandidateJudge(
            plan,
            lambda qdq: core.compile_model(core.read_model(qdq, b""), target, config),
            self._infer_all,
            refused=(RuntimeError,),  # seen: ONNX Runtime 1.30's QDQ of a bias Add
        )
        # The search's result is keyed as it computes.
        judged_by = self.name + ("-bf16" if self._rest else "")
        types = QdqTypes.where(ctx, self.name)
        found = searched_qdq(ctx, plan, types, judge, missed, judged_by=judged_by)
        if found is None:
            return None
        qdq, verdict = found
        if self._rest:
            verdict = dataclasses.replace(verdict, method=verdict.method + self._rest)
        form = _Int8Form(plan, qdq, verdict.method)
        int8, state = self._compile(core, ctx, form, judge.built(qdq))
        return form, int8, state, verdict

    def _compile(
        self,
        core: Any,
        ctx: EngineContext,
        int8: _Int8Form | None = None,
        built: Any = None,
    ) -> tuple[Any, str]:
        """Compile the model (with ``int8``, its int8 form; ``self._method`` says how it
        was made; ``built``: that form compiled already, by the search's judge), for this
        engine's target with the form's config, or import the compiled model from the
        engine cache (not for AUTO, whose choice of device happens at compile time)."""
        import openvino as ov

        target, config = self._target, self._config_for(int8)

        def compile_it() -> Any:
            if int8 is not None and int8.qdq is not None:
                self._method = int8.method
                if built is not None:
                    return built
                return core.compile_model(core.read_model(int8.qdq, b""), target, config)
            model = self._read(core, ctx)
            if int8 is not None:
                model, self._method = quantized_openvino(model, int8.plan)
                self._nncf_model = model
            return core.compile_model(model, target, config)

        if target == "AUTO":
            return compile_it(), "not used (AUTO)"
        cache = ctx.engine_cache
        key = EngineCache.key(
            format=2,
            model=ctx.model.digest,
            engine="openvino",
            version=ov.__version__,
            device=target,
            device_name=core.get_property(target, "FULL_DEVICE_NAME"),
            # The name can be as generic as "AMD EPYC" or "Intel Xeon Processor" (VMs);
            # what the device computes with (BF16, INT8 kernels) keys the blob too.
            capabilities=sorted(core.get_property(target, "OPTIMIZATION_CAPABILITIES")),
            config={k: str(v) for k, v in config.items()},
            shapes={k: list(v) for k, v in ctx.shapes.items()},
            **({} if int8 is None else int8.key),
        )
        problem = cache.problem
        if problem is not None:
            logger.warning("engine cache not used: %s", problem)
            return compile_it(), f"not used: {problem}"
        if int8 is not None and int8.qdq is None:
            # NNCF's model as IR beside the compiled one: what compiles for static shapes.
            self._nncf_ir = EngineCache.key(ir=1, blob=key)
        blob = cache.get(key)
        if blob is not None:
            try:
                compiled = core.import_model(blob, target, config)
                if int8 is not None:
                    self._method = f"{int8.method}, from the engine cache"
                return compiled, f"hit {key[:12]}"
            except Exception as e:  # same key, but this build cannot read it: rebuild
                logger.warning("OpenVINO could not import cached engine %s: %s", key[:12], e)
        compiled = compile_it()
        if int8 is not None and int8.qdq is None:
            cache.put(self._nncf_ir, _ir_bytes(self._nncf_model), {"engine": "openvino"})
        # OpenVINO's export/import loses the meaning of some ops (seen on
        # RotaryEmbedding): an exported engine is never trusted unchecked.
        exported = compiled.export_model()  # a BytesIO in recent releases, bytes before
        data = exported.getvalue() if hasattr(exported, "getvalue") else bytes(exported)
        state = admit(
            cache,
            key,
            data,
            {"engine": "openvino", "device": target},
            ctx.samples,
            lambda feeds: self._infer_all(compiled, feeds),
            lambda feeds: self._infer_all(core.import_model(data, target, config), feeds),
        )
        return compiled, state

    @staticmethod
    def _read(core: Any, ctx: EngineContext) -> Any:
        if ctx.model.path is not None:
            return core.read_model(str(ctx.model.path))
        return core.read_model(ctx.model.data, b"")

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        static, shapes = self._static, self._shapes
        if static is not None or shapes is not None:  # dynamic inputs
            key = shapes_key(feeds, self._input_index)
            if shapes is not None:
                shapes.check(key)
            fixed = None if static is None else static.get(key)
            if fixed is not None:
                try:
                    return self._run_on(fixed, feeds, output_names)
                except _InferFailed:  # the dynamic model runs it, recovering as below
                    static.drop(key)
        state = self._state or self._compiled_again()
        try:
            return self._run_on(state, feeds, output_names)
        except _InferFailed as failed:
            if isinstance(self._translate(failed.error, "run"), OutOfMemoryError):
                # The compiled model keeps the failed shape's memory plan: smaller
                # requests then fail to allocate the same bytes (OpenVINO 2026.4;
                # release_memory() does not reset it). It is dropped now, freeing its
                # memory, and compiled again by the next request: compiling a copy at the
                # edge of memory fails for reasons of its own (OpenVINO could not load
                # its ONNX reader: "Unable to read the model"), and running this
                # request again would need the same memory.
                self._replace(state, None)
                state = None  # this frame outlives the call in the error's traceback
                raise failed.error from None
            # A failed inference can leave the compiled model failing every later
            # request, new ones included (OpenVINO 2026.4). The request runs again on a
            # private copy: if it succeeds there it only met another request's damage,
            # and that healthy copy replaces the broken one; if it fails again, the
            # inputs are the cause, the copy is damaged in turn and is dropped, and the
            # shared model is compiled again, by the next request, without ever seeing
            # these inputs.
            try:
                spare = _Compiled(self._recompile())
            except Exception as e:  # the request's own failure is the one to report
                logger.warning("OpenVINO: could not compile a fresh copy to retry on: %s", e)
                raise failed.error from None
            try:
                outputs = self._run_on(spare, feeds, output_names)
            except _InferFailed:
                self._replace(state, None)
                raise failed.error from None
            self._replace(state, spare)
            return outputs

    def _run_batch(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        if self._batches is None:  # dynamic inputs: a batch is one more shape
            return self._run(feeds, output_names)
        key = shapes_key(feeds, self._input_index)
        form = self._batches.get(key)
        if form is None:
            raise UnsupportedOperationError(
                f"OpenVINO could not compile the model for the batch's input shapes "
                f"{_shapes_shown(dict(key))}"
            )
        try:
            return self._run_on(form, feeds, output_names)
        except _InferFailed as failed:  # the form may be unusable now: not used again
            self._batches.drop(key)
            raise failed.error from None

    def _run_on(
        self, state: _Compiled, feeds: dict[str, np.ndarray], output_names: list[str]
    ) -> list[np.ndarray]:
        import openvino as ov

        request = state.borrow()
        for name, index in self._input_index.items():
            value = feeds[name]
            kind = self._exotic.get(name) if self._exotic else None
            if kind is None:
                # The request reads the caller's memory (no copy, no reshape of the
                # request's own tensor: threads reshaping those deadlocked, 1 in 40).
                # OpenVINO shares only writable arrays ("array is not writeable"), so
                # a read-only one (frombuffer, mmap, a PIL image, onnx's to_array) is
                # copied once; inference never writes an input either way.
                tensor = ov.Tensor(value, shared_memory=value.flags.writeable)
            else:
                # A tensor of the declared type over the packed bytes (OpenVINO's
                # Python binding maps none of these numpy dtypes itself).
                element = getattr(ov.Type, kind.openvino_type)
                tensor = ov.Tensor(to_raw(value, kind), ov.Shape(list(value.shape)), element)
            request.set_input_tensor(index, tensor)
        try:
            # Shared: the binding would copy every output into arrays dropped here (4.2 MB
            # a request of PP-OCRv4 rec); those asked for are copied below.
            request.infer(share_outputs=True)
        except RuntimeError as e:
            # The traceback keeps this frame: without these, it would keep the failed
            # request's memory and the input tensors until a garbage collection (after
            # an allocation failure, what the next request needs).
            request = tensor = value = None
            raise _InferFailed(e) from e
        outputs = []
        for name in output_names:
            tensor = request.get_output_tensor(self._output_index[name])
            kind = self._exotic.get(name) if self._exotic else None
            if kind is None:
                # Copies: the request's output tensors are reused by its next inference.
                outputs.append(np.array(tensor.data, copy=True))
            else:
                shape = tuple(tensor.shape)
                raw = np.empty(kind.nbytes(shape), np.uint8)
                tensor.copy_to(ov.Tensor(raw, tensor.shape, tensor.element_type))
                outputs.append(from_raw(raw, shape, kind))
        state.give_back(request)
        return outputs

    def _infer_all(self, compiled: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Every output of ``compiled`` (a form of this engine's model) on ``feeds``,
        their shapes checked first."""
        if self._shapes is not None:  # keyed as requests are: the model's input order
            names = [spec.name for spec in self._ctx.model.inputs if spec.name in feeds]
            self._shapes.check(shapes_key(feeds, names))
        return _all_outputs(compiled, feeds)

    def _recompile(self) -> Any:
        compiled, _ = self._compile(_shared_core(), self._ctx, self._int8)
        return compiled

    def _config_for(self, form: _Int8Form | None) -> dict[str, Any]:
        """The compile config of the fp32 model (``form`` None) or an int8 form."""
        return self._config if form is None else self._int8_config

    def _replace(self, broken: _Compiled, healthy: _Compiled | None) -> None:
        """Stop serving from ``broken`` (once, however many requests saw it fail); with
        no ``healthy`` copy, the next request compiles one."""
        with self._rebuild_lock:
            if self._state is broken:
                logger.warning(
                    "OpenVINO: a failed request left the compiled model unusable; %s",
                    "replaced it" if healthy is not None else "dropped it",
                )
                self._state = healthy

    def _compiled_again(self) -> _Compiled:
        """The compiled model, compiled again after ``_replace`` dropped it."""
        with self._rebuild_lock:
            if self._state is None:
                # The dropped model may still be held by the failed request's error (a
                # reference cycle through its traceback): collected first, its memory
                # is what compiling needs.
                gc.collect()
                self._state = _Compiled(self._recompile())
            return self._state

    def close(self) -> None:
        self._state = _Compiled(None)
        for name in ("_static", "_batches"):
            forms = getattr(self, name, None)
            setattr(self, name, None)
            if forms is not None:
                forms.clear()

    @classmethod
    def _translate(cls, error: Exception, action: str) -> XpuRuntimeError:
        text = f"openvino {action} failed: {str(error).strip()}"
        lowered = text.lower()
        if "out of memory" in lowered or "failed to allocate" in lowered:
            return OutOfMemoryError(text)
        if "not supported" in lowered or ("cannot create" in lowered and "layer" in lowered):
            return UnsupportedOperationError(text)
        if action == "run" and ("parametermismatch" in lowered or "shape" in lowered):
            return InvalidInputError(text)  # the inputs' shape, seen by shape inference
        if action == "load":
            return ModelLoadError(text)
        if action == "run":
            return ExecutionError(text)  # names the node: "[CPU] MaxPool node with name ..."
        return XpuRuntimeError(text)


@dataclasses.dataclass(frozen=True)
class _Int8Form:
    """How the int8 model OpenVINO compiles is made: NNCF's quantization of the model on
    the plan's calibration inputs, or (``qdq``) a QDQ model that ONNX Runtime's quantizer
    made and the search found passing; ``method`` says how."""

    plan: Int8Plan
    qdq: bytes | None = None
    method: str = "NNCF post-training quantization"

    @property
    def key(self) -> dict[str, str]:
        """What the compiled form depends on beyond the model, for the engine cache."""
        if self.qdq is None:
            return {"nncf": _nncf_version(), "calibration": self.plan.digest}
        return {"qdq": hashlib.sha256(self.qdq).hexdigest()}


class _ShapeCheck:
    """Input shapes checked by OpenVINO's shape inference before a dynamic model runs
    them: its CPU plugin checks them while it runs, not always (OpenVINO 2026.4.1, PP-OCR
    cls at 1x3x1x1, a max pool wider than its input: an exception by default; with one
    inference thread a run without error, an abort or a crash of the process)."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read
        self._model: Any = None  # read at the first shape: the reshaped copy
        self._names: set[str] = set()  # its inputs' names
        self._accepted: set[tuple] = set()
        self._lock = threading.Lock()

    def check(self, key: tuple) -> None:
        """Return if the model takes the input shapes ``key``.

        Raises
        ------
        InvalidInputError
            OpenVINO's shape inference refuses them (the error names the node).
        """
        if key in self._accepted:
            return
        import openvino as ov

        with self._lock:
            if self._model is None:
                self._model = self._read()
                self._names = {name for port in self._model.inputs for name in port.get_names()}
            shapes = {
                name: ov.PartialShape(list(shape)) for name, shape in key if name in self._names
            }
            try:
                self._model.reshape(shapes)
            except RuntimeError as e:
                text = str(e)
                node = re.search(r"with friendly_name '([^']+)'", text)
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                raise InvalidInputError(
                    f"input shapes {_shapes_shown(dict(key))} do not fit the model: "
                    "OpenVINO's shape inference refuses them"
                    + (f" at node {node.group(1)!r}" if node else "")
                    + f" ({lines[-1] if lines else text})"
                ) from None
            if len(self._accepted) >= _SHAPES_KEPT:
                self._accepted.clear()
            self._accepted.add(key)


class _InferFailed(Exception):
    """OpenVINO's infer() failed: the compiled model it ran on may be unusable now."""

    def __init__(self, error: RuntimeError) -> None:
        super().__init__(str(error))
        self.error = error


class _Compiled:
    """One compiled model (with its number of streams, where known) and the pool of
    infer requests made from it."""

    __slots__ = ("compiled", "requests", "streams")

    def __init__(self, compiled: Any, streams: int | None = None) -> None:
        self.compiled = compiled
        self.streams = streams
        self.requests: queue.SimpleQueue = queue.SimpleQueue()

    def borrow(self) -> Any:
        try:
            return self.requests.get_nowait()
        except queue.Empty:
            if self.compiled is None:
                raise InvalidInputError("this OpenVINO engine is closed") from None
            return self.compiled.create_infer_request()

    def give_back(self, request: Any) -> None:
        self.requests.put(request)


def _all_outputs(compiled: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    names = {name for port in compiled.inputs for name in port.get_names()}
    request = compiled.create_infer_request()
    result = request.infer({k: v for k, v in feeds.items() if k in names})
    return [np.array(result[port], copy=True) for port in compiled.outputs]


_COMPUTE_LAYERS = ("Convolution", "Deconvolution", "FullyConnected", "MatMul")
"""The layer types of OpenVINO's CPU runtime model whose int8 kernels bring the speed."""


def _int8_layers(compiled: Any) -> str:
    """How many compute layers of ``compiled`` run in an 8-bit precision, by type, as
    its runtime model reports them (a QDQ model's uint8 weights, for one, run in f32),
    or why that is not known."""
    counts: dict[str, list[int]] = {}
    try:
        for op in compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kind = info["layerType"].astype(str)
            if kind in _COMPUTE_LAYERS:
                count = counts.setdefault(kind, [0, 0])
                count[0] += 1
                count[1] += info["runtimePrecision"].astype(str) in ("u8", "i8")
    except (RuntimeError, KeyError) as e:  # a plugin that reports no runtime precisions
        return f"not reported by {compiled.get_property('EXECUTION_DEVICES')}: {e}"
    if not counts:
        return "no compute layers"
    return ", ".join(f"{eight} of {total} {kind}" for kind, (total, eight) in counts.items())


def _shapes_shown(shapes: dict[str, tuple[int, ...]]) -> str:
    """``3x16``, or with several inputs ``a=3x4 ids=3x3``."""
    if len(shapes) == 1:
        return "x".join(map(str, next(iter(shapes.values()))))
    return " ".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in shapes.items())


def _ir_bytes(model: Any) -> bytes:
    """``model`` as OpenVINO IR in one buffer: the XML's length, the XML, the weights."""
    import tempfile
    from pathlib import Path

    import openvino as ov

    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "model.xml"
        ov.save_model(model, str(xml), compress_to_fp16=False)  # the weights as they are
        text, weights = xml.read_bytes(), xml.with_suffix(".bin").read_bytes()
    return len(text).to_bytes(8, "little") + text + weights


def _read_ir(core: Any, data: bytes | None) -> Any:
    """The model :func:`_ir_bytes` wrote."""
    if data is None:
        raise ModelLoadError("NNCF's int8 model is no longer in the engine cache")
    size = int.from_bytes(data[:8], "little")
    return core.read_model(data[8 : 8 + size], data[8 + size :])


def _nncf_version() -> str:
    """NNCF's version (what an int8 model is made by), read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nncf")
    except PackageNotFoundError:
        return "not installed"


def _plugin_name(target: str, available: list[str]) -> str | None:
    """The name OpenVINO lists ``target`` under (``GPU`` for ``GPU.0`` when alone)."""
    for name in available:
        if name == target or (target == "GPU.0" and name == "GPU"):
            return name
        if target in ("CPU", "NPU") and name.split(".")[0] == target:
            return name
    return None

"""ONNX Runtime engine: execution providers chosen from the device and the policy."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .._errors import (
    BackendUnavailableError,
    CudaError,
    ExecutionError,
    InvalidInputError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from .._inputs import generate_inputs
from ..kernels import FallbackWarning, Support
from ..runtime._discovery import usable_cores
from ..runtime._tensor import Tensor
from ._cache import EngineCache
from ._dtypes import exotic_io, from_raw, to_raw
from ._engine import Engine, EngineContext
from ._int8 import CandidateJudge, Int8Plan, QdqTypes, quantized_qdq, race, searched_qdq
from ._kernel_options import KernelOption, cuda_ep_options, tensorrt_ep_options
from ._placement import RECORD_PLACEMENT, Placement

__all__ = ["OnnxRuntimeEngine"]

logger = logging.getLogger("xpuruntime.engines")

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
    CUDA device. On a CUDA device:

    - with precision ``fp32``, TF32 is turned off (ORT's CUDA EP uses it by default);
      ``fp16`` converts the model's float weights and ops to float16 (inputs and outputs
      stay float32);
    - the session computes on an xpuruntime :class:`~xpuruntime.runtime.Stream` (ORT's
      ``user_compute_stream``), which is what lets device inputs be bound without a copy
      or a device-wide synchronisation;
    - ``policy.cuda_graph`` replays a CUDA graph (see :class:`CudaGraphRunner`);
    - ``policy.kernels`` maps onto CUDA EP and TensorRT EP options, reported in
      ``settings['kernel_policy']``.

    In strict mode ORT's silent CPU fallback for nodes a GPU provider cannot run is
    disabled (``session.disable_cpu_ep_fallback``), so such a model fails to load
    instead. ``run`` is safe to call from several threads, except in CUDA-graph mode.
    """

    name = "onnxrt"
    library = "onnxruntime"
    install_hint = "pip install xpuruntime[onnxruntime] (or [onnxruntime-gpu] for CUDA)"
    device_kinds: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    preference: ClassVar[dict[str, int]] = {"cpu": 0, "cuda": 1}
    _exotic: ClassVar[dict[str, Any]] = {}  # I/O names of dtypes numpy cannot carry
    placement: Placement | None = None
    """Where ORT placed each node (None where this onnxruntime cannot say)."""

    @classmethod
    def _providers(cls, ctx: EngineContext) -> tuple[str, ...]:
        if ctx.policy.providers is not None:
            return ctx.policy.providers
        return ("cuda",) if ctx.device.kind == "cuda" else ("cpu",)

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        precision = ctx.policy.precision
        if precision == "bf16":
            return Support.no(
                "runs the model's own precision, a float16 conversion or int8 (QDQ); "
                "precision=bf16 needs a model converted to bfloat16"
            )
        providers = cls._providers(ctx)
        if precision in ("int8", "auto") and "tensorrt" in providers:
            return Support.no(
                f"precision {precision} quantizes to QDQ for the CPU and CUDA providers; "
                "TensorRT's int8 needs its own calibration, not run here"
            )
        if precision == "int8" and not ctx.calibration_inputs:
            return Support.no("precision int8 needs calibration_inputs to quantize with")
        gpu = [p for p in providers if p != "cpu"]
        if gpu and ctx.device.kind != "cuda":
            return Support.no(f"providers {list(gpu)} need a CUDA device, not {ctx.device}")
        if ctx.device.kind == "cuda" and not gpu:
            return Support.no(f"providers {list(providers)} do not run on {ctx.device}")
        if ctx.policy.cuda_graph and providers[0] != "cuda":
            return Support.no(
                f"cuda_graph needs the CUDA provider first, got providers {list(providers)}"
            )
        available = cls.require().get_available_providers()
        for p in providers:
            if _PROVIDER_NAMES[p] not in available:
                return Support.unavailable(
                    f"onnxruntime {cls.version()} has no {_PROVIDER_NAMES[p]} "
                    f"(available: {', '.join(available)}); install onnxruntime-gpu"
                )
        if ctx.device.kind == "cuda" and not ctx.device.exists:
            return Support.no(f"{ctx.device} was not found by device discovery")
        if ctx.policy.cuda_graph:
            dynamic = [s for s in ctx.model.inputs if s.is_dynamic and s.name not in ctx.shapes]
            if dynamic:
                return Support.no(
                    "cuda_graph needs fixed input shapes; "
                    + ", ".join(str(s) for s in dynamic)
                    + " are dynamic: pass sample_inputs to fix them"
                )
        return Support.yes(f"providers {', '.join(_PROVIDER_NAMES[p] for p in providers)}")

    # -- building ---------------------------------------------------------------------------
    def _provider_options(self, provider: str, ctx: EngineContext) -> dict[str, Any]:
        if provider == "cuda":
            options, rows = cuda_ep_options(ctx.policy.kernels, ctx.policy.precision)
            self._kernel_rows += rows
            if ctx.device.index:
                # Device 0 is the EP's default; naming it makes onnxruntime-gpu 1.31 warn
                # "No registered plugin EP device found" on every session.
                options["device_id"] = ctx.device.index
            if self._stream is not None:
                options["user_compute_stream"] = str(self._stream.handle)
            if ctx.policy.cuda_graph:
                options["enable_cuda_graph"] = "1"
            return options
        if provider == "tensorrt":
            options, rows = tensorrt_ep_options(ctx.policy.kernels)
            self._kernel_rows += rows
            # ORT never invalidates its TensorRT engine cache; a folder per content
            # address (model, versions, device, precision, shapes, options) does.
            key = EngineCache.key(
                model=ctx.model.digest,
                engine="tensorrt",
                onnxruntime=self.version(),
                device=ctx.device.name,
                driver=ctx.device.driver_version,
                precision=ctx.policy.precision,
                shapes={k: list(v) for k, v in ctx.shapes.items()},
                options=options,
            )
            cache = ctx.policy.resolved_cache_dir / "tensorrt" / key[:32]
            return {
                **options,
                **({"device_id": ctx.device.index} if ctx.device.index else {}),
                "trt_fp16_enable": ctx.policy.precision == "fp16",
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": str(cache),
                "trt_timing_cache_enable": True,
                "trt_timing_cache_path": str(cache),
            }
        return {}

    @classmethod
    def _thread_runner(cls, ctx: EngineContext) -> Callable[[int | None], Callable[[], Any]]:
        feeds: list[dict[str, np.ndarray]] = []  # made once, run by every count

        def runner(threads: int | None) -> Callable[[], Any]:
            ort = cls.require()
            counted = dataclasses.replace(ctx, policy=ctx.policy.replace(threads=threads))
            options = cls._policy_options(ort, counted)
            source: Any = str(ctx.model.path) if ctx.model.path else ctx.model.data
            session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
            if not feeds:
                feeds.append(ctx.samples())
            return lambda: session.run(None, feeds[0])

        return runner

    @staticmethod
    def _policy_options(ort: Any, ctx: EngineContext) -> Any:
        """Session options as the policy asks for them (graph optimisation, threads,
        determinism), before what a provider or a mode adds."""
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _LEVELS[ctx.policy.optimization_level]
        )
        # Fatal only: ORT's errors reach the caller as exceptions; its prints are noise.
        options.log_severity_level = 4
        if ctx.policy.threads is not None:
            options.intra_op_num_threads = ctx.policy.threads
        if ctx.policy.kernels is not None and ctx.policy.kernels.deterministic:
            options.use_deterministic_compute = True
        return options

    def _build(self, ctx: EngineContext) -> None:
        ort = self.require()
        self._graph = None
        self._stream = None
        self._kernel_rows: list[KernelOption] = []
        providers = self._providers(ctx)
        if "cuda" in providers or "tensorrt" in providers:
            self._stream = _session_stream(ctx)
        options = self._policy_options(ort, ctx)
        self._requests = 1
        if ctx.policy.performance == "throughput" and ctx.device.kind == "cpu":
            # Requests side by side, one thread each: no thread waits on another's
            # part of an op, and nothing is shared but the model.
            self._requests = ctx.policy.threads or usable_cores()
            options.intra_op_num_threads = 1
        options.add_session_config_entry(RECORD_PLACEMENT, "1")
        if (ctx.policy.strict or ctx.policy.cuda_graph) and "cpu" not in providers:
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        wanted = [(_PROVIDER_NAMES[p], self._provider_options(p, ctx)) for p in providers]
        if "cpu" not in providers and not (ctx.policy.strict or ctx.policy.cuda_graph):
            wanted.append(("CPUExecutionProvider", {}))
        source: Any = str(ctx.model.path) if ctx.model.path else ctx.model.data
        if ctx.policy.precision == "fp16":
            source = _float16_model(ctx)

        loaded: dict[int, Any] = {}  # a session's id -> the model it was made from

        def load(model: Any) -> Any:
            session = ort.InferenceSession(model, sess_options=options, providers=wanted)
            loaded[id(session)] = model  # written at creation: a reused id maps anew
            return session

        session, precision = self._with_precision(ctx, load, source)
        # What a batch of joined requests runs on: the running model with the joined
        # dimensions left free (see _run_batch).
        self._load_session, self._running_model = load, loaded[id(session)]
        self._batch_sessions: dict[tuple, Any] = {}
        self._fixed_dims = {  # per input, (axis, size) of each dimension it declares
            spec.name: [(a, d) for a, d in enumerate(spec.shape) if isinstance(d, int) and d > 0]
            for spec in ctx.model.inputs
            if spec.shape
        }
        self._batch_lock = threading.Lock()
        self._adopt(session, ctx)
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
            else ("disabled" if ctx.policy.strict or ctx.policy.cuda_graph else "allowed"),
        }
        if ctx.device.kind == "cuda":
            use_tf32 = dict(wanted).get("CUDAExecutionProvider", {}).get("use_tf32")
            self._settings["tf32"] = None if use_tf32 is None else bool(use_tf32)
            self._settings["stream"] = None if self._stream is None else hex(self._stream.handle)
        self._check_placement(
            ctx, _PROVIDER_NAMES[providers[0]], allowed=[_PROVIDER_NAMES[p] for p in providers[1:]]
        )
        if ctx.policy.precision == "fp16":
            self._settings["precision"] = "fp16 (model converted; float32 inputs and outputs)"
        elif precision is not None:
            self._settings["precision"] = precision
        if ctx.device.kind == "cpu":
            self._settings["performance"] = (
                f"throughput: {self._requests} requests at once, 1 intra-op thread each"
                if self._requests > 1 or ctx.policy.performance == "throughput"
                else "latency: one request at a time on every intra-op thread"
            )
        if self._kernel_rows:
            self._settings["kernel_policy"] = "; ".join(str(r) for r in self._kernel_rows)
        if ctx.policy.cuda_graph:
            self._start_graph(ort, ctx)

    def _with_precision(
        self, ctx: EngineContext, load: Callable[[Any], Any], source: Any
    ) -> tuple[Any, str | None]:
        """The session to run (``load`` makes one from a model) and what its precision
        line says: under ``int8`` the QDQ model if it passes the gate, under ``auto`` the
        faster of it and the fp32 model that passes; else ``source``'s session."""
        precision = ctx.policy.precision
        if precision not in ("int8", "auto"):
            return load(source), None
        if not ctx.calibration_inputs:
            return load(source), "fp32 (auto: int8 not tried, no calibration_inputs)"
        plan = Int8Plan(ctx)
        types = QdqTypes.where(ctx, self.name)
        model, method = quantized_qdq(ctx, plan, types)
        int8 = load(model)
        verdict = plan.judge(lambda feeds: int8.run(None, feeds), method)
        if not verdict.passed:  # search for one that passes: fewer nodes quantized
            judge = CandidateJudge(plan, load, lambda session, feeds: session.run(None, feeds))
            found = searched_qdq(ctx, plan, types, judge, verdict)
            if found is not None:
                model, verdict = found
                int8 = judge.built(model) or load(model)
            else:
                none = "; searched with compute nodes kept in fp32: none passed"
                verdict = dataclasses.replace(verdict, method=verdict.method + none)
        self._judged = verdict.describe()
        if precision == "int8":
            if plan.settle(verdict, self.name):
                return int8, verdict.describe()
            return load(source), f"fp32 (int8 fell back: {verdict.describe()})"
        fp32 = load(source)
        chosen, line = race(
            plan, verdict, lambda feeds: fp32.run(None, feeds), lambda feeds: int8.run(None, feeds)
        )
        return (int8 if chosen == "int8" else fp32), line

    def _adopt(self, session: Any, ctx: EngineContext) -> None:
        """Run through ``session``: its binding's own run (the Python wrapper's, 4 µs a
        call, re-checks the names validated already and on an EP failure silently
        retries on the CPU), and typed OrtValues for dtypes numpy cannot carry."""
        self._session = session
        self._run_feeds = getattr(session, "_sess", session).run
        self._exotic = exotic_io((*ctx.model.inputs, *ctx.model.outputs))

    def _check_placement(
        self,
        ctx: EngineContext,
        requested: str,
        allowed: list[str] | tuple[str, ...] = (),
        allowed_nodes: frozenset[str] = frozenset(),
    ) -> None:
        """Record where ORT placed each node; nodes off ``requested`` are an error under
        a strict policy, else logged and warned. Excepted: EPs in ``allowed`` (listed by
        the policy's own ``providers``) and nodes named in ``allowed_nodes``."""
        placement = Placement.of(self._session, requested)
        if placement is None:
            self._settings["placement"] = "not reported by this onnxruntime"
            return
        self.placement = placement
        self._settings["placement"] = placement.describe()
        off = [n for n in placement.off_target if n[0] not in allowed and n[1] not in allowed_nodes]
        if not off:
            return
        message = (
            f"{self.name}: {len(off)} of {len(placement.nodes)} nodes run off "
            f"{requested}: {placement.describe_off_target()}"
        )
        if ctx.policy.strict:
            raise UnsupportedOperationError(f"{message} (strict mode allows none)")
        logger.warning(message)
        warnings.warn(message + "; strict=True makes this an error", FallbackWarning, stacklevel=2)

    def _start_graph(self, ort: Any, ctx: EngineContext) -> None:
        from ._ort_device import CudaGraphRunner

        specs = {s.name: s for s in ctx.model.inputs}
        shapes = {name: tuple(ctx.shapes.get(name) or spec.shape) for name, spec in specs.items()}
        self._graph = CudaGraphRunner(
            ort, self._session, shapes, {n: s.dtype for n, s in specs.items()}, self._stream
        )
        self._graph.warm_up(generate_inputs(ctx.model.inputs, shapes=shapes))
        self._settings["cuda_graph"] = "captured, shapes " + ", ".join(
            f"{n}{list(s)}" for n, s in shapes.items()
        )

    # -- running ----------------------------------------------------------------------------
    @property
    def binds_device_memory(self) -> bool:
        return self._stream is not None

    @property
    def always_bound(self) -> bool:
        return self._graph is not None

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        if self._exotic:
            return self._run_exotic(feeds, output_names)
        return self._run_feeds(output_names, feeds, None)

    def _run_batch(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """A batch past the dimensions the model declares (a model exported with batch
        1) runs on a session of the running model with those dimensions left free: ONNX
        Runtime refuses any other size for a declared one."""
        if self._exotic or self._stream is not None or not hasattr(self, "_load_session"):
            return self._run(feeds, output_names)  # device I/O, or QNN's fixed shapes
        grown = tuple(
            (name, axis)
            for name, value in feeds.items()
            for axis, size in self._fixed_dims.get(name, ())
            if value.shape[axis] != size
        )
        if not grown:
            return self._run(feeds, output_names)
        with self._batch_lock:
            session = self._batch_sessions.get(grown)
            if session is None:
                session = self._load_session(_with_free_dims(self._running_model, grown))
                self._batch_sessions[grown] = session
        return session.run(output_names, feeds)

    def _run_exotic(
        self, feeds: dict[str, np.ndarray], output_names: list[str]
    ) -> list[np.ndarray]:
        """Run through OrtValues of the declared ONNX types (see ``_dtypes``)."""
        ort = onnxruntime()
        values = {}
        for name, value in feeds.items():
            kind = self._exotic.get(name)
            if kind is None:
                values[name] = ort.OrtValue.ortvalue_from_numpy(value)
                continue
            raw = to_raw(value, kind)
            tensor = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape), kind.onnx_type)
            ctypes.memmove(tensor.data_ptr(), raw.ctypes.data, raw.nbytes)
            values[name] = tensor
        results = []
        for name, out in zip(output_names, self._session.run_with_ort_values(output_names, values)):
            kind = self._exotic.get(name)
            if kind is None:
                results.append(out.numpy())
                continue
            raw = np.empty(out.tensor_size_in_bytes(), np.uint8)
            ctypes.memmove(raw.ctypes.data, out.data_ptr(), raw.nbytes)
            results.append(from_raw(raw, tuple(out.shape()), kind))
        return results

    def _run_bound(
        self, feeds: dict[str, Any], output_names: list[str], output_device: str | None
    ) -> list[Any]:
        if output_device == "cuda" and self._stream is None:
            raise UnsupportedOperationError(
                f"output_device='cuda' needs a session on a CUDA device; this one runs on "
                f"{self._ctx.device}"
            )
        if self._graph is not None:
            return self._graph.run(feeds, output_names, output_device)
        from ._ort_device import bind_device_input

        ort = onnxruntime()
        binding = self._session.io_binding()
        keep = []  # device inputs ORT borrows: alive until the run has finished
        for name, value in feeds.items():
            if isinstance(value, Tensor):
                keep.append(bind_device_input(ort, binding, name, value, self._stream))
            else:
                binding.bind_cpu_input(name, value)
        for name in output_names:
            if output_device == "cuda":
                binding.bind_output(name, "cuda", self._ctx.device.index)
            else:
                binding.bind_output(name)
        self._session.run_with_iobinding(binding)
        if output_device == "cuda":
            return binding.get_outputs()
        return binding.copy_outputs_to_cpu()

    def close(self) -> None:
        self._graph = None
        self._session = None
        self._batch_sessions = {}
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    @classmethod
    def _translate(cls, error: Exception, action: str) -> XpuRuntimeError:
        text = f"onnxruntime {action} failed: {error}"
        kind = type(error).__name__
        lowered = str(error).lower()
        if "failed to allocate memory" in lowered or "out of memory" in lowered:
            return OutOfMemoryError(text)
        if "cuda graph" in lowered:
            return UnsupportedOperationError(text)
        if "cuda failure" in lowered or "cuda error" in lowered:
            return CudaError(text)
        if kind == "NotImplemented" or "is not a registered function/op" in lowered:
            return UnsupportedOperationError(text)
        if action == "run" and kind == "InvalidArgument":
            return InvalidInputError(text)  # ORT checks the feeds: rank, dims, types
        if action == "load":
            return ModelLoadError(text)
        if action == "run":
            return ExecutionError(text)  # names the node: "while running Reshape node"
        return XpuRuntimeError(text)


def _with_free_dims(model: Any, dims: tuple[tuple[str, int], ...]) -> bytes:
    """``model`` (a path or bytes) with the input dimensions ``dims`` (name, axis) and
    every fixed output dimension made symbolic."""
    import onnx

    proto = onnx.load(model) if isinstance(model, str) else onnx.load_from_string(model)
    if proto.ByteSize() > 2**31 - 2**20:
        raise UnsupportedOperationError(
            "a batch of joined requests needs the model with its batch dimension free; "
            "this one is over 2 GiB, past what onnx serializes in one piece"
        )
    inputs = {value.name: value for value in proto.graph.input}
    for name, axis in dims:
        dim = inputs[name].type.tensor_type.shape.dim[axis]
        dim.ClearField("dim_value")
        dim.dim_param = f"joined_{name}_{axis}"
    for index, value in enumerate(proto.graph.output):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                dim.ClearField("dim_value")
                dim.dim_param = f"joined_out{index}_{axis}"
    return proto.SerializeToString()


def onnxruntime() -> Any:
    """The onnxruntime module (engines built on it may name another library)."""
    return importlib.import_module("onnxruntime")


def _session_stream(ctx: EngineContext) -> Any:
    """The stream the session computes on, or None without cuda-bindings (then device
    inputs cannot be ordered, and only host arrays are accepted)."""
    if importlib.util.find_spec("cuda.bindings") is None:
        if ctx.policy.cuda_graph:
            raise BackendUnavailableError(
                "cuda_graph needs cuda-bindings for its stream: pip install xpuruntime[cuda]"
            )
        logger.info("cuda-bindings is not installed: %s takes host arrays only", ctx.device)
        return None
    from ..runtime import Stream

    # Blocking: the session's work then waits for what callers queued on the legacy
    # default stream (PyTorch's and CuPy's default) without an event per run.
    return Stream(ctx.device, blocking=True)


def _float16_model(ctx: EngineContext) -> bytes:
    """The model with float tensors and ops in float16, inputs and outputs kept float32."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load_from_string(ctx.model.data)
    if ctx.model.path is not None:
        onnx.load_external_data_for_model(proto, str(ctx.model.path.parent))
    converted = convert_float_to_float16(proto, keep_io_types=True)
    return converted.SerializeToString()

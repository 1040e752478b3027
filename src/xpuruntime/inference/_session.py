"""InferenceSession: one ONNX model, one chosen engine, validated inputs, explained."""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from .._errors import InvalidInputError, PolicyError, UnsupportedOperationError, XpuRuntimeError
from .._inputs import InputValidator, generate_inputs
from .._model import Model, TensorSpec
from ..engines import Engine, EngineContext, engines
from ..kernels import Decision, Support
from ..policies import AccuracyPolicy, ExecutionPolicy
from ..runtime import Device, Profiler
from ._batching import Batched, RequestBatcher
from ._requests import RequestQueue
from ._timing import measure_latency

__all__ = ["InferenceSession"]

logger = logging.getLogger("xpuruntime.inference")

# What a candidate's outputs are checked against, and what compare() runs first.
REFERENCE = ExecutionPolicy(engine="onnxrt", device="cpu", precision="fp32", strict=True)


class InferenceSession:
    """Run an ONNX model on the engine and device a policy chooses.

    Parameters
    ----------
    model : str, Path, bytes or onnx.ModelProto
        The model. A missing, truncated or invalid model raises ModelLoadError.
    device : str or Device, optional
        Overrides ``policy.device`` (``'cpu'`` when neither says).
    engine : str, optional
        Overrides ``policy.engine`` (``'auto'`` when neither says).
    policy : ExecutionPolicy, dict or 'auto', optional
        Everything else: precision, strictness, threads, accuracy gate, auto strategy.
        ``'auto'`` (04_architecture §4.3) is the default policy: the engine is chosen
        automatically.
    strict : bool, optional
        Overrides ``policy.strict``: raise instead of falling back.
    sample_inputs : dict or list of arrays, optional
        Inputs used to gate accuracy, to check cached engines, and to measure engines
        under ``auto_strategy='best_performance'`` (generated from the metadata, dynamic
        dims 1, when not given).
    calibration_inputs : list of dicts, optional
        Batches of inputs, as the model will see them, to quantize with under
        ``precision='int8'`` or ``'auto'`` (``onnxrt`` and ``openvino`` hold out
        ``sample_inputs``, else the last fifth of the batches, to judge the int8 model
        on; ``qnn`` quantizes on all of them).

    Raises
    ------
    ModelLoadError
        The model cannot be read or checked, or the chosen engine cannot compile it.
    PolicyError
        An invalid policy value.
    UnsupportedOperationError
        No engine can run the model here, or (strict) the requested one cannot.
    BackendUnavailableError
        (strict) The requested engine's library is missing; says what to install.
    CudaError
        A CUDA device that does not exist.

    Examples
    --------
    >>> import numpy as np, xpuruntime as xrt                    # doctest: +SKIP
    >>> session = xrt.InferenceSession("model.onnx", engine="openvino")  # doctest: +SKIP
    >>> outputs = session.run({"x": np.ones((1, 4), np.float32)})        # doctest: +SKIP
    >>> print(session.explain())                                          # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        device: str | Device | None = None,
        engine: str | None = None,
        policy: ExecutionPolicy | Mapping[str, Any] | None = None,
        *,
        strict: bool | None = None,
        sample_inputs: Any = None,
        calibration_inputs: Sequence[Any] | None = None,
    ) -> None:
        self._engine: Engine | None = None
        self._queue: RequestQueue | None = None
        self._queue_lock = threading.Lock()
        self._closing = False
        self._profiler = Profiler.instance()
        policy = _coerce_policy(policy)
        if strict is not None:
            policy = policy.replace(strict=strict)
        with self._profiler.range("session.load", "session"):
            self._load(model, device, engine, policy, sample_inputs, calibration_inputs)

    def _load(self, model, device, engine, policy, sample_inputs, calibration_inputs) -> None:
        overrides = {}
        if device is not None:
            overrides["device"] = str(device) if isinstance(device, Device) else device
        if engine is not None:
            overrides["engine"] = engine
        self._policy = policy.replace(**overrides) if overrides else policy
        self._model = Model.load(model)
        self._device = Device(self._policy.device)
        if self._policy.cuda_graph and self._device.kind != "cuda":
            raise PolicyError(f"cuda_graph: needs a CUDA device, got device={self._device}")
        if self._device.kind == "cuda":
            self._device.info  # a CUDA device that does not exist is a CudaError, now
        self._output_names = [s.name for s in self._model.outputs]
        self._validate = InputValidator(self._model.inputs)
        self._sample = None if sample_inputs is None else dict(self._validate(sample_inputs))
        shapes = {} if self._sample is None else {n: a.shape for n, a in self._sample.items()}
        calibration = None
        if calibration_inputs is not None:
            if isinstance(calibration_inputs, (Mapping, str, bytes)) or not isinstance(
                calibration_inputs, Sequence
            ):
                raise InvalidInputError(
                    "calibration_inputs: expected a list of input dicts (one per batch), got "
                    f"{type(calibration_inputs).__name__}"
                )
            calibration = [dict(self._validate(feeds)) for feeds in calibration_inputs]
        self._ctx = ctx = EngineContext(
            self._model, self._device, self._policy, shapes, self._sample, calibration
        )
        self._built: dict[str, Engine] = {}
        self._references: dict[str, tuple[str, list[np.ndarray]]] = {}
        try:
            self._decision = engines.select(
                ctx,
                requested=self._policy.engine,
                strategy=self._policy.auto_strategy,
                strict=self._policy.strict,
                accept=self._accept,
                measure=self._measure,
                cache=engines.measurement_cache(ctx),
                cache_key=self._cache_key(ctx),
            )
            gated = [(n, r) for n, r in self._decision.rejected if r.startswith("accuracy")]
            if self._policy.strict and gated:
                raise UnsupportedOperationError(
                    "strict accuracy gate: " + "; ".join(f"{n}: {r}" for n, r in gated),
                    tuple(gated),
                )
            self._engine = self._built.pop(self._decision.chosen)
            policy = self._policy
            self._batcher = RequestBatcher(
                self._model.inputs,
                policy.request_batch,
                throughput=policy.performance == "throughput",
                reduced=policy.precision in ("fp16", "bf16", "default")
                or policy.unquantized_precision == "bf16",
            )
            if self._engine.binds_device_memory:
                self._validate = InputValidator(self._model.inputs, allow_device=True)
        finally:
            for other in self._built.values():
                other.close()
            self._built.clear()

    # -- selection hooks -------------------------------------------------------------------
    def _sample_feeds(self) -> dict[str, np.ndarray]:
        if self._sample is None:
            seed = self._policy.accuracy.seed if self._policy.accuracy else 0
            self._sample = generate_inputs(self._model.inputs, seed=seed)
        return self._sample

    def _accept(self, engine_cls: type[Engine]) -> Support:
        engine = self._built.get(engine_cls.name)
        if engine is None:
            engine = engine_cls(self._ctx)
            self._built[engine_cls.name] = engine
        gate = self._policy.accuracy
        fallback = self._policy.engine != "auto" and engine_cls.name != self._policy.engine
        if engine.judged is not None:  # int8, judged on inputs held out from calibration
            return Support.yes(f"built; {engine.judged}{_placed(engine)}")
        if gate is None and not fallback:
            return Support.yes(f"built ({_settings_line(engine.settings)})")
        if gate is None:
            # A fallback runs an engine nobody asked for: its results are checked
            # against another engine with the default tolerances, or said unverified.
            gate = AccuracyPolicy()
            try:
                feeds = self._ctx.samples()
            except InvalidInputError as e:
                return Support.yes(f"built; results unverified: {e}{_placed(engine)}")
        else:
            feeds = self._sample_feeds()
        reference = self._reference_outputs(
            feeds, engine_cls.name, fallback, engine.reference_model
        )
        if reference is None:
            return Support.yes(
                "built; results unverified: no other engine could run the model to check against"
            )
        against, expected = reference
        from .._metrics import compare_outputs

        try:
            outputs = engine.run(feeds, self._output_names)
        except InvalidInputError as e:
            if self._ctx.sample_inputs is not None:
                raise
            # Made-up inputs can fit no model (an image of 1x1 pixels): say so.
            raise InvalidInputError(
                f"{e}; the accuracy gate's inputs were generated (every dynamic dimension "
                "1): pass sample_inputs of the shapes the model runs"
            ) from e
        rtol, atol, why = engine.accuracy_tolerance(gate.rtol, gate.atol)
        rows = compare_outputs(
            engine_cls.name, self._output_names, outputs, expected, rtol, atol, gate
        )
        worst = next((r for r in rows if not r.passed), None) or max(
            rows, key=lambda r: r.max_rel if np.isfinite(r.max_rel) else np.inf
        )
        figures = f"max_abs={worst.max_abs:.3g}, rel_l2={worst.rel_l2:.3g}"
        if gate.metric == "top1_agreement":
            figures += f", top1_agreement={worst.top1_agreement:.3g}"
        figures += f" on {worst.output!r}"
        if why:
            figures += f"; tolerance: {why}"
        if all(row.passed for row in rows):
            return Support.yes(
                f"accuracy gate passed against {against} ({figures}){_placed(engine)}"
            )
        engine.close()
        del self._built[engine_cls.name]
        logger.warning("accuracy gate rejects %s: %s", engine_cls.name, figures)
        rule = f"rtol={rtol:g}, atol={atol:g}" if gate.metric == "allclose" else gate.rule
        return Support.no(f"accuracy gate failed against {against} ({rule}): {figures}")

    def _reference_outputs(
        self,
        feeds: dict[str, np.ndarray],
        candidate: str,
        fallback: bool,
        model: bytes | None = None,
    ) -> tuple[str, list[np.ndarray]] | None:
        """``(which engine, outputs)`` to check a candidate against: ONNX Runtime on the
        CPU in fp32, else (for a fallback) any other engine that runs the model on the
        CPU; None when none can. ``model`` replaces the session's model where the
        candidate runs another form of it (a quantized one)."""
        source = self._model if model is None else Model.load(model)
        if source.digest in self._references:
            return self._references[source.digest]
        names = ["onnxrt", *(n for n in engines.order("cpu") if n != "onnxrt")]
        if fallback and self._device.kind == "cpu":
            names = [n for n in names if n != candidate]
        if not fallback:
            names = names[:1]
        policy = REFERENCE.replace(cache_dir=self._policy.cache_dir)
        for name in names:
            try:
                with InferenceSession(source, policy=policy.replace(engine=name)) as session:
                    found = (f"{name} cpu fp32", session.run(dict(feeds)))
            except XpuRuntimeError as e:
                logger.info("reference %s cannot run the model: %s", name, e)
                continue
            self._references[source.digest] = found
            return found
        return None

    def _measure(self, engine_cls: type[Engine]) -> float:
        engine = self._built[engine_cls.name]
        feeds = self._sample_feeds()
        return measure_latency(lambda: engine.run(feeds, self._output_names)).p50

    def _cache_key(self, ctx: EngineContext) -> str | None:
        if self._policy.auto_strategy != "best_performance":
            return None
        feeds = self._sample_feeds()
        key = {
            "model": self._model.digest,
            "device": str(self._device),
            "device_name": self._device.info.name if self._device.exists else None,
            "policy": self._policy.replace(engine="auto").fingerprint(),
            "versions": {
                name: engines.get(name).version() for name in engines.order(self._device.kind)
            },
            "shapes": {name: list(a.shape) for name, a in feeds.items()},
        }
        if ctx.calibration_inputs and self._policy.precision in ("int8", "auto"):
            from ..engines._int8 import calibration_digest

            # What the int8 candidates were quantized and judged on: which form runs.
            key["calibration"] = calibration_digest(ctx.calibration_inputs)
            if ctx.sample_inputs is not None:
                key["held_out"] = calibration_digest([ctx.sample_inputs])
        return json.dumps(key, sort_keys=True)

    # -- queries ---------------------------------------------------------------------------
    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The inputs to feed: name, shape (symbolic dims as str) and dtype."""
        return self._model.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._model.outputs

    @property
    def engine(self) -> str:
        """The name of the engine that runs this session."""
        return self._decision.chosen

    @property
    def engine_settings(self) -> dict[str, Any]:
        """What the engine was configured with (providers, precision hint, threads)."""
        return self._live_engine().settings

    @property
    def device(self) -> Device:
        return self._device

    @property
    def policy(self) -> ExecutionPolicy:
        """The effective policy (the given one with ``device``/``engine`` overrides)."""
        return self._policy

    @property
    def decision(self) -> Decision:
        """How the engine was chosen: candidates, rejections with reasons, source."""
        return self._decision

    @property
    def model(self) -> Model:
        return self._model

    def explain(self) -> str:
        """The decision and the engine's settings, for a person to read."""
        lines = [
            f"model {self._model.name} (sha256 {self._model.digest[:12]}) on "
            f"{self._device}, precision {self._policy.precision}",
            self._decision.explain(),
        ]
        if self._engine is not None:
            lines.append(f"  settings: {_settings_line(self._engine.settings)}")
            lines.append(f"  run_many: {'; '.join(self._batcher.decisions) or 'nothing run yet'}")
        return "\n".join(lines)

    # -- actions ---------------------------------------------------------------------------
    def run(
        self,
        inputs: Any,
        output_names: Sequence[str] | None = None,
        *,
        output_device: str | None = None,
        as_tensors: bool = False,
    ) -> list[Any]:
        """Run the model.

        Parameters
        ----------
        inputs : dict of str to array, or list of arrays
            numpy arrays or host DLPack tensors; validated before the engine sees them
            (see :mod:`xpuruntime._inputs` for the dtype rule). A session on a
            CUDA device also takes CUDA tensors (PyTorch, CuPy, any DLPack or
            ``__cuda_array_interface__`` producer): bound where they lie, without a
            copy, after the producer's queued work; their dtype must match exactly.
        output_names : list of str, optional
            Which outputs to return, in that order (None: all; an empty list is an
            error, since it would run the model for nothing).
        as_tensors : bool
            Return :class:`~xpuruntime.Tensor` s (over the same memory) instead of
            numpy arrays or OrtValues.
        output_device : {None, 'cpu', 'cuda'}
            ``'cuda'`` leaves the outputs on the device as ONNX Runtime ``OrtValue`` s,
            which speak DLPack (``torch.from_dlpack(out)``). In CUDA-graph mode they are
            the session's static buffers, overwritten by the next ``run``.

        Returns
        -------
        list of numpy.ndarray, or of DLPack tensors with ``output_device='cuda'``

        Raises
        ------
        InvalidInputError
            Unknown or missing names, wrong rank, fixed dimension or dtype, non-arrays,
            a device tensor on another GPU, a shape change in CUDA-graph mode.
        UnsupportedOperationError
            ``output_device='cuda'`` on an engine or device that cannot; a concurrent
            ``run`` in CUDA-graph mode.
        """
        engine = self._engine
        if engine is None:
            raise InvalidInputError("this InferenceSession is closed")
        feeds = self._validate(inputs)
        profiler = self._profiler
        if as_tensors:
            from ..runtime._tensor import Tensor

            outputs = self.run(feeds, output_names, output_device=output_device)
            return [
                Tensor.from_numpy(o) if type(o) is np.ndarray else Tensor.from_dlpack(o)
                for o in outputs
            ]
        if output_names is None and output_device is None and not profiler.recording:
            return engine.run(feeds, self._output_names)
        names = (
            self._output_names if output_names is None else self._checked_output_names(output_names)
        )
        if output_device not in (None, "cpu", "cuda"):
            raise InvalidInputError(
                f"output_device: expected None, 'cpu' or 'cuda', got {output_device!r}"
            )
        device = None if output_device == "cpu" else output_device
        if not profiler.recording:
            return engine.run(feeds, names, device)
        profiler.push_range(f"session.run {self.engine}", "session")
        try:
            return engine.run(feeds, names, device)
        finally:
            profiler.pop_range()

    def run_async(
        self,
        inputs: Any,
        output_names: Sequence[str] | None = None,
        *,
        copy_inputs: bool = True,
    ) -> Future:
        """Start a run and return at once; the future holds its outputs.

        Requests run on the session's workers, as many at once as the engine keeps busy
        (``requests`` in :attr:`engine_settings`' performance line: more than one under
        ``performance='throughput'``). The inputs are validated and copied now, so the
        caller may reuse its buffers at once (``copy_inputs=False``: read in place).
        When :attr:`max_pending` requests are unfinished, this waits for one to finish
        (backpressure). Safe to call from several threads.

        Parameters
        ----------
        inputs, output_names
            As for :meth:`run` (host arrays; outputs are returned as numpy arrays).
        copy_inputs
            False: the arrays are read where they are, not copied, and the caller leaves
            them unchanged until the future is done (as for :meth:`run_many`).

        Returns
        -------
        concurrent.futures.Future
            ``result()`` gives the outputs, or raises this request's error
            (:class:`~xpuruntime.InvalidInputError` for bad inputs, an engine error for
            a failed run); a failed request fails its own future only.

        Raises
        ------
        InvalidInputError
            The session is closed.
        """
        copying = _flag("copy_inputs", copy_inputs)
        queue = self._request_queue()
        engine = self._live_engine()
        try:
            feeds = self._validate(inputs)
            if copying:
                feeds = {
                    name: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
                    for name, value in feeds.items()
                }
            names = (
                self._output_names
                if output_names is None
                else self._checked_output_names(output_names)
            )
        except XpuRuntimeError as e:
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        return queue.submit(lambda: engine.run(feeds, names))

    def run_many(
        self,
        inputs: Iterable[Any],
        output_names: Sequence[str] | None = None,
        *,
        copy_inputs: bool = True,
    ) -> Iterator[list[np.ndarray]]:
        """Run every input of ``inputs`` (an iterable, read as results are needed),
        keeping the engine's requests busy, and yield the outputs in input order.

        Consecutive inputs of one signature may run joined into one batch along the
        model's batch axis (the policy's ``request_batch``; under
        ``performance='throughput'`` by default, where a model computes an input faster
        than a Python call per input allows): only once a first batch has matched its
        inputs run alone, within rounding. Each input is copied as it is read, so the
        caller may reuse its buffers (``copy_inputs=False``: read in place). At most
        :attr:`max_pending` requests are read ahead of the result being yielded. A
        failed input raises its error when its turn comes, after the results before
        it; the requests behind it are cancelled, as they are when the caller stops
        iterating early.

        Parameters
        ----------
        inputs
            An iterable of input dicts (or what :meth:`run` takes), read as needed.
        output_names
            As for :meth:`run`.
        copy_inputs
            False: an input run alone is read where it is, not copied (a joined one is
            still copied into its batch), and the caller leaves its arrays unchanged
            until its result is yielded: for inputs made fresh for each request
            (decoded images, audio chunks sliced from a file), where the copy costs a
            pass over memory per input (PP-OCR cls's 884 KB input on a 16-core Xeon:
            0.75-0.78x ``benchmark_app`` copied, 0.86-0.92x read in place).
        """
        copying = _flag("copy_inputs", copy_inputs)
        queue = self._request_queue()
        engine = self._live_engine()
        names = (
            self._output_names if output_names is None else self._checked_output_names(output_names)
        )
        validate = self._validate
        requests = self._batcher.requests(
            inputs,
            validate,
            lambda feeds: engine.run(feeds, names),
            lambda feeds: engine.run_batch(feeds, names),
            lambda: engine.requests,
            copying,
        )
        pending: deque[tuple[Future, Batched | None]] = deque()

        def results() -> Iterator[list[np.ndarray]]:
            future, batched = pending.popleft()
            if batched is None:
                yield future.result()
                return
            for outcome in future.result():
                if isinstance(outcome, XpuRuntimeError):
                    raise outcome
                yield outcome

        try:
            for request in requests:
                if len(pending) >= self.max_pending:
                    yield from results()
                if isinstance(request, Batched):
                    future = queue.submit(lambda r=request: _run_joined(engine, r, names))
                elif request.outputs is not None:
                    future = Future()
                    future.set_result(request.outputs)
                elif request.valid:
                    future = queue.submit(lambda f=request.feeds: engine.run(f, names))
                else:  # validated where it runs: its error raised at its turn
                    future = queue.submit(lambda f=request.feeds: engine.run(validate(f), names))
                pending.append((future, request if isinstance(request, Batched) else None))
            while pending:
                yield from results()
        finally:
            for future, _ in pending:
                future.cancel()

    @property
    def max_pending(self) -> int:
        """How many requests ``run_async`` lets be unfinished before it waits: twice the
        engine's concurrent requests, so the next ones are ready when one finishes."""
        return 2 * self._live_engine().requests

    def _request_queue(self) -> RequestQueue:
        with self._queue_lock:
            if self._closing:
                raise InvalidInputError("this InferenceSession is closed")
            engine = self._live_engine()
            if self._queue is None:
                self._queue = RequestQueue(engine.requests, 2 * engine.requests)
            elif engine.requests > self._queue.workers:
                self._queue.widen(engine.requests, 2 * engine.requests)
            return self._queue

    def _checked_output_names(self, output_names: Any) -> list[str]:
        if isinstance(output_names, (str, bytes)) or not isinstance(output_names, Sequence):
            raise InvalidInputError(
                f"output_names: expected a list of output names or None, got "
                f"{type(output_names).__name__}"
            )
        names = list(output_names)
        if not names:
            raise InvalidInputError(
                f"output_names: empty; pass None for all outputs {self._output_names}"
            )
        unknown = [n for n in names if not isinstance(n, str) or n not in self._output_names]
        if unknown:
            raise InvalidInputError(
                f"unknown output name(s) {unknown[:8]!r}; the model's outputs are "
                f"{self._output_names}"
            )
        return names

    def close(self) -> None:
        """Release the engine (idempotent); ``run`` raises afterwards. Asynchronous
        requests running now finish first; those still queued are cancelled."""
        with self._queue_lock:
            queue, self._queue, self._closing = self._queue, None, True
        if queue is not None:
            queue.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _live_engine(self) -> Engine:
        if self._engine is None:
            raise InvalidInputError("this InferenceSession is closed")
        return self._engine

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"InferenceSession(model={self._model.name!r}, engine={self.engine!r}, "
            f"device={str(self._device)!r}, precision={self._policy.precision!r})"
        )


def _coerce_policy(policy: Any) -> ExecutionPolicy:
    if policy is None:
        return ExecutionPolicy()
    if isinstance(policy, ExecutionPolicy):
        return policy
    if isinstance(policy, Mapping):
        return ExecutionPolicy.from_dict(dict(policy))
    if isinstance(policy, str) and policy.lower() == "auto":
        return ExecutionPolicy(engine="auto")
    raise PolicyError(
        f"policy: expected an ExecutionPolicy, a dict, 'auto' or None, got {type(policy).__name__}"
    )


def _placed(engine: Engine) -> str:
    """Where the engine's backend placed the nodes, for a decision's reason (the dispatch
    log carries it); empty where the engine does not say."""
    placement = engine.settings.get("placement")
    return f"; placement: {placement}" if placement else ""


def _settings_line(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name}: expected True or False, got {value!r}")
    return value


def _run_joined(engine: Engine, batched: Batched, names: list[str]) -> list[Any]:
    """Each joined input's outputs; where the batch fails, each input run alone, so that
    a bad one fails with its own error (the others' outputs kept)."""
    try:
        return batched.split(engine.run_batch(batched.feeds, names))
    except XpuRuntimeError as e:
        logger.warning(
            "a batch of %d joined inputs failed (%s); running each alone", batched.size, e
        )
    outcomes: list[Any] = []
    for feeds in batched.rows():
        try:
            outcomes.append(engine.run(feeds, names))
        except XpuRuntimeError as e:
            outcomes.append(e)
    return outcomes

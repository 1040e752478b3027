"""int8 from the caller's calibration inputs: quantized by the backend's own tool, and
kept only if it passes the accuracy gate on inputs held out from calibration.

ONNX Runtime quantizes with ``onnxruntime.quantization.quantize_static`` to QDQ
(per-channel weights; the model's opset is upgraded to 13 first where it is older, and
the upgrade checked), OpenVINO with NNCF's post-training quantization of its own model
(ONNX Runtime's QDQ model quantized whole ran slower than fp32 on OpenVINO: 118 vs 94 ms
on PP-OCRv4's detector). Where the first model misses the gate, both engines search
ONNX Runtime's QDQ models with fewer nodes quantized (:func:`searched_qdq`), each judged
on the engine that will run it; with only its compute ops quantized, OpenVINO runs
PP-OCRv4 det 1.39x its fp32. Every quantized form is kept in the engine cache, keyed on
the calibration data's digest too. The gate compares the int8 model with ONNX Runtime
running the fp32 model on the CPU, by the policy's metric
(:data:`~xpuruntime.policies.INT8_GATE` when the policy names none).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import InvalidInputError, UnsupportedOperationError
from ..kernels import FallbackWarning
from ..policies import INT8_GATE, AccuracyPolicy
from ._cache import CacheKey, EngineCache
from ._engine import EngineContext

__all__ = [
    "Int8Plan",
    "Int8Verdict",
    "QdqTypes",
    "calibration_digest",
    "quantized_openvino",
    "quantized_qdq",
    "quiet",
    "race",
    "searched_qdq",
]

logger = logging.getLogger("xpuruntime.engines")

PER_CHANNEL_OPSET = 13
"""The opset from which DequantizeLinear takes an ``axis`` (per-channel scales): a
per-channel QDQ model of an older opset does not load (``Unrecognized attribute: axis``)."""

_QUIET = threading.Lock()

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Int8Verdict:
    """How an int8 model was made and how far it is from the fp32 model."""

    method: str
    calibrated_on: int
    held_out: int
    gate: AccuracyPolicy
    rows: tuple[Any, ...]  # OutputComparison, one per output

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    @property
    def worst(self) -> Any:
        """The output furthest from passing (the first failing one, else the largest
        error by the gate's metric)."""
        failing = [row for row in self.rows if not row.passed]
        if failing:
            return failing[0]
        key = self.gate.metric
        sign = -1.0 if key == "top1_agreement" else 1.0
        return max(self.rows, key=lambda row: sign * np.nan_to_num(row.figure(key), nan=np.inf))

    @property
    def measured(self) -> str:
        """The worst output's figure by the gate's metric: ``"rel_l2 0.021 on 'out'"``."""
        row = self.worst
        if row.error:
            return f"{row.output!r}: {row.error}"
        return f"{self.gate.metric} {row.figure(self.gate.metric):.3g} on {row.output!r}"

    def describe(self) -> str:
        verdict = "passed" if self.passed else "failed"
        return (
            f"int8 by {self.method}, calibrated on {self.calibrated_on} input(s); "
            f"{self.measured} over {self.held_out} held-out input(s) against the fp32 "
            f"model (gate {self.gate.rule}): {verdict}"
        )


class Int8Plan:
    """The calibration inputs split into those to quantize with and those to judge on,
    and the gate that judges.

    Held out: ``sample_inputs`` when given (a calibration batch equal to them is left
    out), else the last fifth (at least one) of the calibration batches; the rest
    calibrates.

    Raises
    ------
    InvalidInputError
        No calibration inputs, or a single batch and no sample inputs (nothing would be
        left to judge the int8 model on).
    """

    def __init__(self, ctx: EngineContext) -> None:
        batches = list(ctx.calibration_inputs or [])
        if not batches:
            raise InvalidInputError(
                f"precision {ctx.policy.precision}: int8 needs calibration_inputs (a list "
                "of input dicts, as the model will see them) to quantize with"
            )
        if ctx.sample_inputs is not None:
            # Held out means not calibrated on: a batch equal to them is left out.
            held = calibration_digest([ctx.sample_inputs])
            batches = [b for b in batches if calibration_digest([b]) != held]
            if not batches:
                raise InvalidInputError(
                    "precision int8: the sample_inputs are the only calibration batch; "
                    "the int8 model must be judged on inputs it was not calibrated on"
                )
            self.calibration, self.held_out = batches, [ctx.sample_inputs]
        elif len(batches) >= 2:
            cut = len(batches) - max(1, len(batches) // 5)
            self.calibration, self.held_out = batches[:cut], batches[cut:]
        else:
            raise InvalidInputError(
                "precision int8: one calibration batch and no sample_inputs leave nothing "
                "to check the int8 model on; pass at least 2 calibration batches (the last "
                "fifth is held out) or sample_inputs"
            )
        self.gate = ctx.policy.accuracy or INT8_GATE
        self._ctx = ctx
        self._reference: list[list[np.ndarray]] | None = None

    @functools.cached_property
    def digest(self) -> str:
        """The calibration batches' digest (:func:`calibration_digest`)."""
        return calibration_digest(self.calibration)

    def reference(self) -> list[list[np.ndarray]]:
        """The fp32 model's outputs on the held-out inputs (ONNX Runtime on the CPU)."""
        if self._reference is None:
            session = _ort_session(_model_bytes(self._ctx))
            self._reference = [session.run(None, feeds) for feeds in self.held_out]
        return self._reference

    def judge(
        self, run: Callable[[Feeds], list[np.ndarray]], method: str, part: slice = slice(None)
    ) -> Int8Verdict:
        """Run the held-out inputs (``part`` of them) through ``run`` and compare with the
        fp32 model."""
        from .._metrics import compare_batches

        names = [s.name for s in self._ctx.model.outputs]
        held_out = self.held_out[part]
        outputs = [run(feeds) for feeds in held_out]
        rows = compare_batches("int8", names, outputs, self.reference()[part], self.gate)
        verdict = Int8Verdict(method, len(self.calibration), len(held_out), self.gate, tuple(rows))
        logger.info("%s", verdict.describe())
        return verdict

    def unrunnable(self, method: str, error: Exception, part: slice = slice(None)) -> Int8Verdict:
        """The verdict on an int8 model the engine could not compile or run: it fails,
        naming the error, as a model that misses the gate does (a search goes on)."""
        from .._metrics import OutputComparison

        last_line = (str(error).strip().splitlines() or [""])[-1]
        text = f"{type(error).__name__}: {last_line[:200]}"
        rows = tuple(
            OutputComparison("int8", s.name, np.nan, np.nan, np.nan, False, error=text)
            for s in self._ctx.model.outputs
        )
        verdict = Int8Verdict(
            method, len(self.calibration), len(self.held_out[part]), self.gate, rows
        )
        logger.info("%s", verdict.describe())
        return verdict

    def settle(self, verdict: Int8Verdict, engine: str) -> bool:
        """Whether to keep the int8 model: yes if it passed; if not, an error under a
        strict policy, else one :class:`~xpuruntime.FallbackWarning` (fp32 runs)."""
        if verdict.passed:
            return True
        message = (
            f"{engine}: the int8 model misses the accuracy gate ({self.gate.rule}): "
            f"{verdict.measured} over {verdict.held_out} held-out input(s)"
        )
        if self._ctx.policy.strict:
            raise UnsupportedOperationError(
                f"{message}; strict mode keeps no fp32 fallback (calibrate on inputs like "
                "the ones the model will see, or loosen accuracy)"
            )
        logger.warning("%s; running fp32", message)
        warnings.warn(
            f"{message}; running the fp32 model instead (strict=True makes this an error)",
            FallbackWarning,
            stacklevel=4,
        )
        return False


AUTO_MARGIN = 0.03
"""How much faster than fp32 ``precision='auto'`` needs int8 to be, in the median round."""


def race(
    plan: Int8Plan,
    verdict: Int8Verdict,
    run_fp32: Callable[[Feeds], Any],
    run_int8: Callable[[Feeds], Any],
) -> tuple[str, str]:
    """``precision='auto'``: time both forms on a held-out input, alternating rounds so
    that a slow spell of the machine falls on both, and keep int8 where it passed the
    gate and is at least ``AUTO_MARGIN`` faster in the median round (paired within each
    round: a machine whose speed drifts between rounds once made ONNX Runtime's auto keep
    an int8 model 0.82x its fp32 on a Xeon, judged by separate medians); else fp32, the
    model as given. Returns ``(chosen, line)``, the line listing every candidate."""
    from .._timing import compare_calls, sample

    feeds = plan.held_out[0]

    def per_call(fn: Callable[[], Any]) -> float:
        times = sample(fn, warmup=1, min_iterations=3, max_iterations=30, min_seconds=0.05)
        return float(np.median(times))

    timed = compare_calls(
        {"fp32": lambda: run_fp32(feeds), "int8": lambda: run_int8(feeds)}, per_call, rounds=5
    )
    median = {name: t or np.inf for name, t in timed.medians.items()}
    ratio = timed.speed_ratio("int8", "fp32") if np.isfinite(median["int8"]) else 0.0
    chosen = "int8" if verdict.passed and ratio >= 1 + AUTO_MARGIN else "fp32"
    gate = "passed" if verdict.passed else "failed"
    line = (
        f"{chosen} (auto): fp32 {median['fp32'] * 1e3:.3g} ms; int8 {median['int8'] * 1e3:.3g} "
        f"ms ({ratio:.2f}x fp32, kept from {1 + AUTO_MARGIN:.2f}x), {verdict.measured} "
        f"({gate} {plan.gate.rule}); {verdict.method}"
    )
    logger.info("precision auto: %s", line)
    return chosen, line


def calibration_digest(batches: list[Feeds]) -> str:
    """SHA-256 of calibration batches: names, dtypes, shapes and bytes, in order."""
    digest = hashlib.sha256()
    for feeds in batches:
        for name in sorted(feeds):
            value = np.ascontiguousarray(feeds[name])
            digest.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
            digest.update(value.tobytes())
    return digest.hexdigest()


# -- ONNX Runtime: quantize_static to QDQ --------------------------------------------------
def _qdq_key(ctx: EngineContext, plan: Int8Plan, types: QdqTypes, engine: str, **more) -> CacheKey:
    """The engine cache's key of a QDQ model: everything its bytes depend on (the model,
    onnxruntime's quantizer, the calibration inputs, the activation and weight types) and
    ``more``."""
    import onnxruntime

    return EngineCache.key(
        format=1,
        model=ctx.model.digest,
        engine=engine,
        onnxruntime=onnxruntime.__version__,
        calibration=plan.digest,
        activations=types.activations,
        weights=types.weights,
        **more,
    )


@dataclass(frozen=True)
class QdqTypes:
    """The int8 types of a QDQ model's activations and weights, ``'uint8'`` or
    ``'int8'``, as the engine that runs it computes them best (:meth:`where`)."""

    activations: str
    weights: str

    @classmethod
    def where(cls, ctx: EngineContext, engine: str) -> QdqTypes:
        """The types for ``engine`` on ``ctx``'s device: int8 and int8 on CUDA. Elsewhere
        uint8 activations (x86 without VNNI runs U8S8 fastest: PP-OCRv4 det 1.25x fp32,
        S8S8 0.7x) and int8 weights. The exception: ONNX Runtime on an x86 CPU without
        VNNI saturates uint8 x int8 sums in int16, so it gets uint8 weights (det: rel_l2
        0.080 with int8, 0.044 with uint8). OpenVINO runs uint8 weights in f32."""
        if ctx.device.kind == "cuda":
            return cls("int8", "int8")
        info = ctx.device.info
        x86 = str(info.details.get("arch", "")).lower() in ("x86_64", "amd64")
        saturates = ctx.device.kind == "cpu" and x86 and not info.supports_int8
        return cls("uint8", "uint8" if saturates and engine == "onnxrt" else "int8")


def quantized_qdq(ctx: EngineContext, plan: Int8Plan, types: QdqTypes) -> tuple[bytes, str]:
    """The model quantized to QDQ of ``types`` on ``plan.calibration`` (from the engine
    cache when it was before), and how."""
    cache = ctx.engine_cache
    key = _qdq_key(ctx, plan, types, "onnxrt-qdq")
    stored = cache.get_entry(key) if cache.problem is None else None
    if stored is not None:
        model, meta = stored
        return model, f"{meta.get('method', 'onnxruntime quantize_static')}, from the engine cache"
    model, method = _quantize_static(ctx, plan.calibration, types)
    cache.put(key, model, {"engine": "onnxrt-qdq", "method": method})
    return model, method


COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
"""The ops whose int8 kernels bring the speed; quantizing the elementwise ops around them
(Add, Mul, ...) mostly adds error (PP-OCRv4 rec: rel_l2 0.55 with them, 0.38 without)."""

SEARCH_GROUPS = 8
"""How many runs of consecutive compute nodes the search ranks (one trial each)."""

SEARCH_MARGIN = 0.9
"""The share of the gate's bound (of its distance from a perfect score, for
``top1_agreement``) that a bisected model must stay within on the inputs it is chosen on."""


@dataclass(frozen=True)
class Recipe:
    """What ``quantize_static`` quantizes: the op types (None: all it supports) and the
    nodes kept in fp32."""

    ops: tuple[str, ...] | None = None
    excluded: tuple[str, ...] = ()
    why: str = ""

    def describe(self, compute_nodes: int) -> str:
        if self.ops is None and not self.excluded:
            return ""
        kept = f"{', '.join(self.ops)} only" if self.ops else "every op it supports"
        if not self.excluded:
            return f"; quantized {kept}"
        shown = ", ".join(self.excluded[:3]) + (", ..." if len(self.excluded) > 3 else "")
        return (
            f"; quantized {kept}, {len(self.excluded)} of {compute_nodes} compute nodes "
            f"kept in fp32 ({shown}): {self.why}"
        )


def _quantize_static(
    ctx: EngineContext, calibration: list[Feeds], types: QdqTypes
) -> tuple[bytes, str]:
    with _Prepared(ctx) as prepared:
        return prepared.quantize(calibration, types, Recipe())


class _Prepared:
    """The model as ``quantize_static`` takes it (opset upgraded where needed, onnxruntime's
    pre-processing), in a scratch directory for as long as the ``with`` block lasts."""

    def __init__(self, ctx: EngineContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> _Prepared:
        import onnx
        from onnxruntime.quantization.shape_inference import quant_pre_process

        self._scratch = tempfile.TemporaryDirectory(prefix="xrt-int8-")
        scratch = Path(self._scratch.name)
        proto = onnx.load_from_string(_model_bytes(self._ctx))
        opset = max(
            (o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0
        )
        self.notes: list[str] = []
        self.per_channel = True
        if opset < PER_CHANNEL_OPSET:
            calibration = self._ctx.calibration_inputs or []
            upgraded = _upgraded(proto, opset, calibration[0]) if calibration else None
            self.per_channel = upgraded is not None
            if upgraded is not None:
                proto = upgraded
                self.notes.append(f"opset {opset} upgraded to {PER_CHANNEL_OPSET}")
            else:
                self.notes.append(f"per-tensor weights: opset {opset} could not be upgraded")
        self.source = scratch / "model.onnx"
        prepared = scratch / "model.pre.onnx"
        self.large = proto.ByteSize() > 2**31 - 2**20
        onnx.save(proto, str(self.source), save_as_external_data=self.large)
        with quiet():
            try:  # onnxruntime's recommended step: shape inference, BN folding
                quant_pre_process(str(self.source), str(prepared), skip_symbolic_shape=True)
                self.source = prepared
                self.notes.append("pre-processed")
            except Exception as e:  # the step is an optimisation, never a requirement
                logger.info("quant_pre_process skipped: %s", e)
        graph = onnx.load(str(self.source), load_external_data=False).graph
        self.compute_nodes = [n.name for n in graph.node if n.op_type in COMPUTE_OPS and n.name]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scratch.cleanup()

    def quantize(
        self, calibration: list[Feeds], types: QdqTypes, recipe: Recipe
    ) -> tuple[bytes, str]:
        """The QDQ model ``recipe`` makes, and how it was made."""
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        qtype = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self._feeds = iter(calibration)

            def get_next(self) -> Feeds | None:
                return next(self._feeds, None)

        target = Path(self._scratch.name) / "model.qdq.onnx"
        ranges = {}
        if _takes_range_cache():  # the trials of one op set calibrate once (onnxruntime >= 1.32)
            name = "ranges-" + ("all" if recipe.ops is None else "-".join(recipe.ops)) + ".json"
            ranges["calibration_cache_path"] = str(Path(self._scratch.name) / name)
        with quiet():
            quantize_static(
                str(self.source),
                str(target),
                Reader(),
                quant_format=QuantFormat.QDQ,
                per_channel=self.per_channel,
                activation_type=qtype[types.activations],
                weight_type=qtype[types.weights],
                use_external_data_format=self.large,
                op_types_to_quantize=None if recipe.ops is None else list(recipe.ops),
                nodes_to_exclude=list(recipe.excluded),
                **ranges,
            )
        return target.read_bytes(), self.describe(types, recipe)

    def describe(self, types: QdqTypes, recipe: Recipe) -> str:
        """How ``recipe``'s model is made, for the precision line."""
        scales = "per-channel" if self.per_channel else "per-tensor"
        why = " (no VNNI: uint8 x int8 products saturate)" if types.weights != "int8" else ""
        return (
            f"onnxruntime quantize_static (QDQ, {scales} {types.weights} weights{why}, "
            f"{types.activations} activations"
            + (f"; {', '.join(self.notes)}" if self.notes else "")
            + ")"
            + recipe.describe(len(self.compute_nodes))
        )


class CandidateJudge:
    """Judges the search's candidates where they will run: ``build(model)`` makes the
    engine's runnable form of a QDQ model (a session, a compiled model), ``run(built,
    feeds)`` runs it. The last candidate is kept with its built form (held, so that its
    id stays its own), for the model found to be run without building it again. A build
    that raises one of ``refused`` is a miss (:meth:`Int8Plan.unrunnable`); any other
    error propagates."""

    def __init__(
        self,
        plan: Int8Plan,
        build: Callable[[bytes], Any],
        run: Callable[[Any, Feeds], list[np.ndarray]],
        refused: tuple[type[Exception], ...] = (),
    ) -> None:
        self._plan, self._build, self._run, self._refused = plan, build, run, refused
        self._last: dict[str, Any] = {}

    def __call__(self, candidate: bytes, how: str, part: slice) -> Int8Verdict:
        last = self._last
        if last.get("model") is not candidate:
            last.clear()
            last["model"] = candidate
            try:
                last["built"] = self._build(candidate)
            except self._refused as e:
                last["error"] = e
        if "error" in last:
            return self._plan.unrunnable(how, last["error"], part)
        built = last["built"]
        return self._plan.judge(lambda feeds: self._run(built, feeds), how, part)

    def built(self, candidate: bytes) -> Any | None:
        """``candidate``'s built form if it was the last judged (and built), else None."""
        return self._last.get("built") if self._last.get("model") is candidate else None


def searched_qdq(
    ctx: EngineContext,
    plan: Int8Plan,
    types: QdqTypes,
    judge: Callable[[bytes, str, slice], Int8Verdict],
    missed: Int8Verdict,
    *,
    judged_by: str = "onnxrt",
) -> tuple[bytes, Int8Verdict] | None:
    """After the plain QDQ model ``missed`` the gate: the first model found that passes
    it (from the engine cache when found before), or None.

    Tried in order, each judged as the plain one was: the compute ops alone quantized
    (:data:`COMPUTE_OPS`); then the fewest first compute nodes in fp32
    (:func:`_prefix_fp32`); then, with the compute nodes in graph order cut into
    :data:`SEARCH_GROUPS` runs, runs kept in fp32 one at a time, each round keeping the
    run that brings the model closest to the gate (a greedy forward selection: one trial
    per run left per round), until the model passes, no run helps, or half the runs are
    fp32; then single nodes ranked by their harm (:func:`_ranked_fp32`). The first model
    that passes has the fewest first nodes, runs, or ranked nodes in fp32 its stage found.

    The search chooses on the first half of the held-out inputs; the model it finds is
    then judged on the other half, which it never saw (with one held-out input, on that
    one: the line says so); a model that misses there sends the search to its stage's
    next model, with more nodes in fp32 (up to half), then to its next stage.
    ``judge(model, method, part)`` judges one model on ``part`` of the held-out inputs.
    ``judged_by`` names the engine that runs the models judged (the model found is the
    one that passes where it runs), and keys the model found in the engine cache
    (with, on a CPU, whether it has VNNI); a model found before is judged again, and
    searched for again where it misses.
    """
    cache = ctx.engine_cache
    # What the judgement depends on: on a CPU, whether its int8 dot products saturate
    # (x86 without VNNI: ONNX Runtime's uint8 x int8 products pass through int16).
    where = {"cpu_vnni": ctx.device.info.supports_int8} if ctx.device.kind == "cpu" else {}
    key = _qdq_key(
        ctx, plan, types, f"{judged_by}-qdq-search",
        held_out=calibration_digest(plan.held_out), gate=plan.gate.rule, **where,
    )  # fmt: skip
    search, confirm, seen = _search_halves(plan)
    stored = cache.get_entry(key) if cache.problem is None else None
    if stored is not None:
        model, meta = stored
        verdict = judge(model, f"{meta['method']}, from the engine cache", confirm)
        if verdict.passed:
            return model, verdict
        # Found where it computed otherwise (a CPU without VNNI saturates ONNX Runtime's
        # uint8 x int8 products; another OpenVINO): searched again here, and replaced.
        logger.info("int8 search: the model found before misses here: %s", verdict.measured)
    found = _candidates(ctx, plan, types, lambda m, how: judge(m, how, search), missed)
    with contextlib.closing(found):
        for model, chosen in found:
            verdict = judge(model, chosen.method + seen, confirm)
            if verdict.passed:
                cache.put(key, model, {"engine": "onnxrt-qdq", "method": chosen.method + seen})
                return model, verdict
            logger.info(
                "int8 search: its model missed on the inputs it did not see: %s",
                verdict.measured,
            )
    return None


@functools.cache
def _takes_range_cache() -> bool:
    """Whether this onnxruntime's ``quantize_static`` keeps the calibrated ranges in a
    file for later calls (``calibration_cache_path``)."""
    import inspect

    from onnxruntime.quantization import quantize_static

    return "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _candidates(ctx, plan, types, judge, missed) -> Iterator[tuple[bytes, Int8Verdict]]:
    """The models that pass on the inputs the search chooses on, stage by stage (the
    compute ops alone quantized, first nodes in fp32, runs of them, ranked nodes), the
    fewest nodes in fp32 first within a stage, each made only if the one before it
    missed where it was confirmed."""
    with _Prepared(ctx) as prepared:

        def attempt(recipe: Recipe) -> tuple[bytes, Int8Verdict]:
            model, method = prepared.quantize(plan.calibration, types, recipe)
            return model, judge(model, method)

        model, verdict = attempt(Recipe(ops=COMPUTE_OPS))
        if verdict.passed:
            yield model, verdict
        nodes = prepared.compute_nodes

        def trial(kept: tuple[str, ...]) -> tuple[bytes, Int8Verdict]:
            return attempt(Recipe(COMPUTE_OPS, kept))

        for stage in (
            lambda: _prefix_fp32(nodes, trial),
            lambda: _greedy_fp32(nodes, trial, verdict),
            lambda: _ranked_fp32(nodes, trial),
        ):
            for model, passed, kept, why in stage():
                why = (
                    f"{why}; with them in fp32 {passed.measured} (all quantized: {missed.measured})"
                )
                method = prepared.describe(types, Recipe(COMPUTE_OPS, kept, why))
                yield model, replace(passed, method=method)


def _greedy_fp32(
    nodes: list[str],
    attempt: Callable[[tuple[str, ...]], tuple[Any, Int8Verdict]],
    start: Int8Verdict,
) -> Iterator[tuple[Any, Int8Verdict, tuple[str, ...], str]]:
    """Runs of ``nodes`` (compute nodes in graph order, cut into :data:`SEARCH_GROUPS`)
    kept in fp32 one at a time: each round tries every run left with those kept so far
    (``attempt(kept)`` makes and judges a model) and keeps the one that brings the model
    closest to the gate; it ends when a model passes (yielded with the nodes kept and
    why), when no run brings it closer than ``start`` or the last round, or when half the
    runs are fp32 (then int8 is not worth it)."""
    if len(nodes) < 2:
        return
    size = -(-len(nodes) // SEARCH_GROUPS)
    groups = [tuple(nodes[i : i + size]) for i in range(0, len(nodes), size)]
    chosen: list[int] = []
    closest = _distance(start)
    while len(chosen) < len(groups) // 2:
        best: tuple[float, int] | None = None
        for index in (i for i in range(len(groups)) if i not in chosen):
            runs = sorted([*chosen, index])
            kept = tuple(n for i in runs for n in groups[i])
            artifact, verdict = attempt(kept)
            if verdict.passed:
                named = ", ".join(str(i + 1) for i in runs)
                why = (
                    f"run(s) {named} of {len(groups)} runs in graph order, chosen one at a "
                    "time by which brought the model closest to the gate"
                )
                yield artifact, verdict, kept, why
                return
            distance = _distance(verdict)
            if best is None or distance < best[0]:
                best = (distance, index)
        if best is None or best[0] >= closest:
            break  # no run's fp32 brings it closer
        closest = best[0]
        chosen.append(best[1])
    logger.info("int8 search: no model passed (%d runs of compute nodes)", len(groups))


def _prefix_fp32(
    nodes: list[str], attempt: Callable[[tuple[str, ...]], tuple[Any, Int8Verdict]]
) -> Iterator[tuple[Any, Int8Verdict, tuple[str, ...], str]]:
    """The fewest first compute nodes kept in fp32 (PP-OCRv4 det's stem is its most
    sensitive part), then more of them (:func:`_fewest`): one run, so the int8 model
    changes precision once, where scattered fp32 nodes each add a quantize and a
    dequantize (PP-OCRv4 det at 640x640 under OpenVINO: its first 32 of 64 nodes in fp32
    ran 1.39x fp32; 29 ranked nodes scattered over the model, 0.84x)."""
    found = False
    for artifact, verdict, count in _fewest(nodes, attempt):
        found = True
        why = f"the first {count} of {len(nodes)} compute nodes in graph order"
        yield artifact, verdict, tuple(nodes[:count]), why
    if not found:
        logger.info("int8 search: no model passed (first nodes in fp32)")


def _ranked_fp32(
    nodes: list[str], attempt: Callable[[tuple[str, ...]], tuple[Any, Int8Verdict]]
) -> Iterator[tuple[Any, Int8Verdict, tuple[str, ...], str]]:
    """Compute nodes kept in fp32 by their own measured harm: each node quantized alone
    (every other kept in fp32) is judged, the nodes ranked by how far that takes the
    model from the reference, and the fewest of the most harmful kept in fp32, then more
    of them (:func:`_fewest`). Where runs of nodes cannot get there (PP-OCRv4's detector
    at 640x640: its stem's depthwise convolutions each cost rel_l2 0.06-0.20 alone, while
    whole runs of later nodes cost little), ranking single nodes does (25 of 64 in fp32:
    rel_l2 0.042 on pages it did not choose on)."""
    if len(nodes) < 2:
        return
    harm = {}
    for node in nodes:
        _, verdict = attempt(tuple(n for n in nodes if n != node))
        harm[node] = _distance(verdict)
    ranked = sorted(nodes, key=lambda n: -harm[n])  # stable: graph order among equals
    found = False
    for artifact, verdict, count in _fewest(ranked, attempt):
        found = True
        why = (
            f"the {count} most harmful of {len(nodes)} compute nodes, ranked by each one's "
            f"harm quantized alone (worst: {ranked[0]}, {harm[ranked[0]]:.3g})"
        )
        yield artifact, verdict, tuple(ranked[:count]), why
    if not found:
        logger.info("int8 search: no model passed (%d nodes ranked)", len(nodes))


def _fewest(
    ordered: list[str], attempt: Callable[[tuple[str, ...]], tuple[Any, Int8Verdict]]
) -> Iterator[tuple[Any, Int8Verdict, int]]:
    """The fewest first nodes of ``ordered`` whose fp32 makes a model that passes, with
    its model and verdict: k = 1, 2, 4, ... up to half the nodes, the first k that
    passes narrowed by bisection; nothing when half do not pass. Passing here keeps
    :data:`SEARCH_MARGIN` from the gate's bound: the fewest that passes on the inputs
    chosen on is at the edge, and missed on the others (PP-OCRv4 det under OpenVINO:
    the first 30 nodes gave rel_l2 0.0496 there, 0.0506 on the others; 32 gave 0.044
    and 0.042).

    Asked for more (its model missed where it was confirmed), it yields larger counts
    that pass, a quarter more nodes each time (at least one), up to half the nodes. On
    an AVX2-only CPU the 20 most harmful of PP-OCRv4 det's 64 convolutions passed on one
    page (rel_l2 0.040) and missed on the other (0.056)."""
    if len(ordered) < 2:
        return
    tried: dict[int, tuple[Any, Int8Verdict] | None] = {}

    def passing(count: int) -> bool:
        if count not in tried:
            artifact, verdict = attempt(tuple(ordered[:count]))
            tried[count] = (artifact, verdict) if _with_margin(verdict) else None
        return tried[count] is not None

    limit = len(ordered) // 2
    high = next((k for k in _doubling(limit) if passing(k)), None)
    if high is None:
        return
    low = max((k for k in tried if k < high), default=0)  # the doubling's last miss
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if passing(middle) else (middle, high)
    count = high
    while True:
        if passing(count):
            artifact, verdict = tried[count]
            yield artifact, verdict, count
        if count >= limit:
            return
        count = min(limit, count + max(1, count // 4))


def _with_margin(verdict: Int8Verdict) -> bool:
    """Whether ``verdict`` passed within :data:`SEARCH_MARGIN` of its gate's bound
    (a gate with no bound, ``allclose``, has no margin: passing is enough)."""
    bound = verdict.gate.bound
    if not verdict.passed or bound is None:
        return verdict.passed
    limit = 1.0 - bound if verdict.gate.metric == "top1_agreement" else bound
    return _distance(verdict) <= SEARCH_MARGIN * limit


def _doubling(limit: int):
    """1, 2, 4, ... below ``limit``, then ``limit``."""
    count = 1
    while count < limit:
        yield count
        count *= 2
    yield limit


def _search_halves(plan: Int8Plan) -> tuple[slice, slice, str]:
    """The held-out inputs a search chooses on and those that then judge its model (the
    first and second half; with one held-out input, that one for both, and the line that
    says so)."""
    count = len(plan.held_out)
    if count < 2:
        return slice(None), slice(None), " (chosen on the one held-out input that judges it)"
    return slice(0, count // 2), slice(count // 2, None), ""


def _distance(verdict: Int8Verdict) -> float:
    """How far the worst output is from the reference by the gate's metric (lower is
    closer)."""
    figure = float(verdict.worst.figure(verdict.gate.metric))
    if not np.isfinite(figure):
        return np.inf
    return 1.0 - figure if verdict.gate.metric == "top1_agreement" else figure


def _upgraded(proto: Any, opset: int, feeds: Feeds) -> Any:
    """``proto`` converted to opset 13 by onnx's version converter, if the converted
    model computes what the original does on ``feeds`` (else None, said why)."""
    import onnx
    from onnx import version_converter

    try:
        upgraded = version_converter.convert_version(proto, PER_CHANNEL_OPSET)
        onnx.checker.check_model(upgraded)
        before = _ort_session(proto.SerializeToString()).run(None, feeds)
        after = _ort_session(upgraded.SerializeToString()).run(None, feeds)
    except Exception as e:
        logger.info("opset %d -> %d upgrade not used: %s", opset, PER_CHANNEL_OPSET, e)
        return None
    for a, b in zip(before, after):
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
            logger.info("opset %d -> %d upgrade not used: it changed the outputs", opset, 13)
            return None
    return upgraded


# -- OpenVINO: NNCF ------------------------------------------------------------------------
def quantized_openvino(model: Any, plan: Int8Plan) -> tuple[Any, str]:
    """``model`` (an ``openvino.Model``) quantized by ``nncf.quantize`` on the
    calibration inputs, and how."""
    try:
        import nncf
    except ImportError as e:
        from .._errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"precision int8 on OpenVINO quantizes with NNCF, which is not installed "
            f"(pip install xpuruntime[int8]): {e}"
        ) from e
    names = {name for port in model.inputs for name in port.get_names()}
    items = [{k: v for k, v in feeds.items() if k in names} for feeds in plan.calibration]
    # NNCF's transformer scheme keeps attention's own products in float (what its docs
    # advise for such models): on PP-OCRv4's SVTR recognizer it lifted the top-1
    # agreement with the fp32 model from 0.925 to 0.947.
    attention = _has_attention(model)
    extra = {"model_type": nncf.ModelType.TRANSFORMER} if attention else {}
    with quiet():
        nncf.set_log_level(logging.ERROR)
        quantized = nncf.quantize(model, nncf.Dataset(items), subset_size=len(items), **extra)
    how = "nncf.quantize, transformer model type" if attention else "nncf.quantize"
    return quantized, f"NNCF {nncf.__version__} post-training quantization ({how})"


def _has_attention(model: Any) -> bool:
    """Whether an OpenVINO model has attention: a Softmax, and a MatMul of two computed
    tensors (no weight among its inputs)."""
    ops = model.get_ordered_ops()
    if not any(op.get_type_name() == "Softmax" for op in ops):
        return False
    for op in ops:
        if op.get_type_name() != "MatMul":
            continue
        sources = [value.get_node() for value in op.input_values()]
        if not any(_is_constant(node) for node in sources):
            return True
    return False


def _is_constant(node: Any) -> bool:
    """A Constant, or a Constant seen through the conversions OpenVINO puts on weights."""
    while node.get_type_name() in ("Convert", "FakeConvert", "Reshape") and node.get_input_size():
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant"


# -- shared ----------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet():
    """Hold back what the quantizers print: onnxruntime's pre-processing advice on the
    root logger, NNCF's progress bars on stdout. Logged at DEBUG instead; one
    quantization at a time, since stdout is the process's."""
    with _QUIET:
        root = logging.getLogger()
        was_disabled, root.disabled = root.disabled, True
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield
        finally:
            root.disabled = was_disabled
            text = (out.getvalue() + err.getvalue()).strip()
            if text:
                logger.debug("quantizer output: %s", text[-4000:])


def _model_bytes(ctx: EngineContext) -> bytes:
    """The model with its external data inline (what ONNX Runtime reads from bytes)."""
    if ctx.model.path is None:
        return ctx.model.data
    import onnx

    proto = onnx.load_from_string(ctx.model.data)
    onnx.load_external_data_for_model(proto, str(ctx.model.path.parent))
    return proto.SerializeToString()


def _ort_session(model: bytes) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])

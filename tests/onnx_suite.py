"""The ONNX project's backend node tests, run through a raw backend and through xpuruntime.

The installed onnx wheel ships the node tests as code (``onnx.backend.test.case.node``),
not data: collecting them builds each model and computes its expected outputs with
onnx's reference implementations. Each case runs in a worker process, so that a backend
crash (OpenVINO segfaults on some cases) or hang fails that case and nothing else.

Run as a script to print the pass counts recorded in BENCHMARKS.md::

    python tests/onnx_suite.py [onnxrt|openvino ...]
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

ENGINES = ("onnxrt", "openvino")
CASE_TIMEOUT = 120.0
"""Seconds one case may take in a worker (collecting the suite there included)."""


@dataclass(frozen=True)
class Outcome:
    """How one case went: ``pass``, ``fail``, ``crash``, ``timeout`` or ``out_of_scope``."""

    status: str
    detail: str = ""


@lru_cache(maxsize=1)
def cases() -> dict[str, Any]:
    """Every node test case of the installed onnx, by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {case.name: case for case in collect_testcases()}


def non_tensor_io(case: Any) -> str | None:
    """The first input or output that is not a tensor (sessions take tensors only)."""
    graph = case.model.graph
    for value in [*graph.input, *graph.output]:
        if not value.type.HasField("tensor_type"):
            return value.name
    return None


# -- comparison, as onnx's own backend runner does it ----------------------------------------
def _difference(expected: Any, got: Any, rtol: float, atol: float) -> str | None:
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.dtype != got.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if expected.shape != got.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if expected.dtype == object:
        return None if np.array_equal(expected, got) else "values differ"
    if expected.dtype.kind == "V" or expected.dtype.name.startswith(("float8", "float4")):
        expected, got = expected.astype(np.float32), got.astype(np.float32)
    try:
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    except AssertionError as e:
        return "values differ: " + " ".join(str(e).split())[:200]
    return None


def _check(case: Any, run: Any) -> str | None:
    """Run every data set of ``case`` through ``run(inputs) -> outputs``; the first
    difference, or None."""
    for inputs, expected in case.data_sets:
        got = run(list(inputs))
        if len(got) != len(expected):
            return f"{len(got)} outputs, expected {len(expected)}"
        for index, (e, g) in enumerate(zip(expected, got)):
            difference = _difference(e, g, case.rtol, case.atol)
            if difference is not None:
                return f"output {index}: {difference}"
    return None


def _feed_names(case: Any) -> list[str]:
    initializers = {t.name for t in case.model.graph.initializer}
    return [v.name for v in case.model.graph.input if v.name not in initializers]


# -- the raw backends, used as their own documentation shows ---------------------------------
def _raw_onnxrt(case: Any) -> str | None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(
        case.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = _feed_names(case)
    return _check(case, lambda inputs: session.run(None, dict(zip(names, inputs))))


def _raw_openvino(case: Any) -> str | None:
    import openvino as ov

    core = ov.Core()
    model = core.read_model(case.model.SerializeToString(), b"")
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ports = {name for port in compiled.inputs for name in port.get_names()}
    outputs = [
        next(p for p in compiled.outputs if v.name in p.get_names())
        for v in case.model.graph.output
    ]
    names = _feed_names(case)

    def run(inputs: list[Any]) -> list[Any]:
        result = compiled.create_infer_request().infer(
            {n: x for n, x in zip(names, inputs) if n in ports}
        )
        return [np.array(result[port]) for port in outputs]

    return _check(case, run)


# -- through xpuruntime, in four ways ---------------------------------------------------------
def _narrowed(x: Any) -> Any:
    """``x`` in a narrower dtype that holds every value exactly (the session widens it
    back), or None."""
    if not isinstance(x, np.ndarray) or x.size == 0:
        return None
    narrower = {
        np.dtype(np.float32): np.float16,
        np.dtype(np.float64): np.float32,
        np.dtype(np.int64): np.int32,
        np.dtype(np.int32): np.int16,
    }.get(x.dtype)
    if narrower is None:
        return None
    with np.errstate(all="ignore"):
        y = x.astype(narrower)
        same = np.array_equal(y.astype(x.dtype), x, equal_nan=x.dtype.kind == "f")
    return y if same else None


def _strided(x: Any) -> Any:
    """The same values as a non-contiguous view."""
    if not isinstance(x, np.ndarray) or x.ndim == 0 or x.size == 0 or x.dtype == object:
        return x
    return np.repeat(x, 2, axis=-1)[..., ::2]


def _xrt(case: Any, engine: str) -> str | None:
    import xpuruntime as xrt

    policy = {"strict": True}
    first = xrt.InferenceSession(case.model, engine=engine, policy=policy)
    difference = _check(case, lambda inputs: first.run(inputs))
    if difference is not None:
        return difference
    # A second session: on OpenVINO, the engine the first one stored in the cache.
    second = xrt.InferenceSession(case.model, engine=engine, policy=policy)
    difference = _check(case, lambda inputs: second.run(inputs))
    if difference is not None:
        cache = second.engine_settings.get("engine_cache", "no cache")
        return f"second session ({cache}): {difference}"
    difference = _check(case, lambda inputs: first.run([_strided(x) for x in inputs]))
    if difference is not None:
        return f"non-contiguous inputs: {difference}"
    narrowed = [_narrowed(x) for x in case.data_sets[0][0]]
    if any(x is not None for x in narrowed):

        def run(inputs: list[Any]) -> list[Any]:
            return first.run([n if (n := _narrowed(x)) is not None else x for x in inputs])

        difference = _check(case, run)
        if difference is not None:
            return f"inputs in a narrower dtype: {difference}"
    return None


def run_case(engine: str, which: str, name: str) -> Outcome:
    """Run one case (in a worker process): ``which`` is ``raw`` or ``xrt``."""
    case = cases()[name]
    if which == "xrt" and non_tensor_io(case) is not None:
        return Outcome("out_of_scope", f"{non_tensor_io(case)!r} is not a tensor")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            if which == "raw":
                run = _raw_onnxrt if engine == "onnxrt" else _raw_openvino
                difference = run(case)
            else:
                difference = _xrt(case, engine)
    except Exception as e:
        text = " ".join(str(e).split())[:300]
        return Outcome("fail", f"{type(e).__name__}: {text}")
    return Outcome("fail", difference) if difference else Outcome("pass")


def _start_worker(cache_dir: str) -> None:
    os.environ["XPURUNTIME_CACHE_DIR"] = cache_dir
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class SuiteRunner:
    """Runs cases in one worker process, replaced when a case crashes or hangs."""

    def __init__(self, cache_dir: str) -> None:
        self._cache_dir = cache_dir
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __call__(self, engine: str, which: str, name: str) -> Outcome:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self._cache_dir,),
                max_tasks_per_child=400,  # OpenVINO's memory grows over many compiles
            )
        future = self._pool.submit(run_case, engine, which, name)
        try:
            return future.result(timeout=CASE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            self.close()
            return Outcome("timeout", f"no result after {CASE_TIMEOUT:.0f} s")
        except concurrent.futures.process.BrokenProcessPool:
            self.close()
            return Outcome("crash", "the worker process died (a crash in the backend)")

    def close(self) -> None:
        if self._pool is None:
            return
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


def main(engines: list[str]) -> None:
    """Print, per engine, how many cases the raw backend and xpuruntime pass."""
    with tempfile.TemporaryDirectory() as cache:
        runner = SuiteRunner(cache)
        try:
            for engine in engines:
                counts = {"raw": 0, "xrt": 0, "worse": 0, "better": 0, "out_of_scope": 0}
                worse = []
                for name in cases():
                    raw = runner(engine, "raw", name)
                    mine = runner(engine, "xrt", name)
                    counts["raw"] += raw.status == "pass"
                    counts["xrt"] += mine.status == "pass"
                    counts["out_of_scope"] += mine.status == "out_of_scope"
                    if raw.status == "pass" and mine.status not in ("pass", "out_of_scope"):
                        counts["worse"] += 1
                        worse.append(f"  {name}: {mine.detail}")
                    counts["better"] += raw.status != "pass" and mine.status == "pass"
                print(
                    f"{engine}: {len(cases())} cases, "
                    + ", ".join(f"{k} {v}" for k, v in counts.items())
                )
                print("\n".join(worse))
        finally:
            runner.close()


if __name__ == "__main__":
    main(sys.argv[1:] or list(ENGINES))

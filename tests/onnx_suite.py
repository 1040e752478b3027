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


def data_sets(case: Any) -> list[tuple[list[Any], list[Any]]]:
    """The case's inputs and expected outputs, loaded as users load the suite's
    protobuf files: ``numpy_helper.to_array``, which gives read-only arrays, and
    ml_dtypes arrays for the types numpy lacks (int2, float8e8m0, ...). Loaded once per
    case: every way of holding the inputs converts a copy."""
    return _loaded(case.name)


@lru_cache(maxsize=4)
def _loaded(name: str) -> list[tuple[list[Any], list[Any]]]:
    from onnx import TensorProto, numpy_helper

    def load(x: Any) -> Any:
        return numpy_helper.to_array(x) if isinstance(x, TensorProto) else x

    return [
        ([load(x) for x in inputs], [load(x) for x in expected])
        for inputs, expected in cases()[name].data_sets
    ]


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


def _check(case: Any, run: Any, way: Any = None) -> str | None:
    """Run every data set of ``case`` through ``run(inputs) -> outputs``, the inputs
    converted by ``way`` (writable copies by default); the first difference, or None."""
    convert = _writable if way is None else way
    for inputs, expected in data_sets(case):
        got = run([convert(x) for x in inputs])
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
def _lacks_numpy_type(x: Any) -> bool:
    """Whether ``x`` is an ml_dtypes array (a type numpy and the backends' numpy paths
    lack), which crosses to a raw backend as a typed tensor of packed bytes."""
    return isinstance(x, np.ndarray) and x.dtype.type.__module__.startswith("ml_dtypes")


def _is_packed_type(onnx_type: int) -> bool:
    """Whether ONNX element type ``onnx_type`` maps to an ml_dtypes dtype."""
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(onnx_type).type.__module__.startswith("ml_dtypes")


def _packed(x: np.ndarray) -> tuple[int, bytes]:
    """The ONNX element type and the bytes a tensor of it holds (onnx packs them)."""
    from onnx import numpy_helper

    proto = numpy_helper.from_array(x)
    return proto.data_type, proto.raw_data


def _unpacked(onnx_type: int, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    """The array that ``data``, the bytes of a tensor of ``onnx_type``, holds."""
    from onnx import helper, numpy_helper

    return numpy_helper.to_array(helper.make_tensor("y", onnx_type, shape, data, raw=True))


def _raw_onnxrt(case: Any) -> str | None:
    import ctypes

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(
        case.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = _feed_names(case)
    outputs = [v.name for v in case.model.graph.output]
    kinds = {v.name: v.type.tensor_type.elem_type for v in case.model.graph.output}

    packed_outputs = any(_is_packed_type(kind) for kind in kinds.values())

    def run(inputs: list[Any]) -> list[Any]:
        if not packed_outputs and not any(_lacks_numpy_type(x) for x in inputs):
            return session.run(None, dict(zip(names, inputs)))
        values = {}
        for name, x in zip(names, inputs):
            if not _lacks_numpy_type(x):
                values[name] = ort.OrtValue.ortvalue_from_numpy(x)
                continue
            onnx_type, data = _packed(x)
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), onnx_type)
            ctypes.memmove(value.data_ptr(), data, len(data))
            values[name] = value
        results = []
        for name, out in zip(outputs, session.run_with_ort_values(outputs, values)):
            if not _is_packed_type(kinds[name]):
                results.append(out.numpy())
                continue
            data = ctypes.string_at(out.data_ptr(), out.tensor_size_in_bytes())
            results.append(_unpacked(kinds[name], tuple(out.shape()), data))
        return results

    return _check(case, run)


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

    kinds = [v.type.tensor_type.elem_type for v in case.model.graph.output]

    def typed(x: Any, port: Any) -> Any:
        if not _lacks_numpy_type(x):
            return x
        tensor = ov.Tensor(port.get_element_type(), ov.Shape(list(x.shape)))
        _, data = _packed(x)
        tensor.data.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        return tensor

    def run(inputs: list[Any]) -> list[Any]:
        by_name = {name: port for port in compiled.inputs for name in port.get_names()}
        request = compiled.create_infer_request()
        request.infer({n: typed(x, by_name[n]) for n, x in zip(names, inputs) if n in ports})
        results = []
        for port, kind in zip(outputs, kinds):
            tensor = request.get_tensor(port)
            if _is_packed_type(kind):
                data = np.array(tensor.data).reshape(-1).view(np.uint8).tobytes()
                results.append(_unpacked(kind, tuple(tensor.shape), data))
            else:
                results.append(np.array(tensor.data))
        return results

    return _check(case, run)


# -- through xpuruntime, with inputs held in every way users hold them -----------------------
def _writable(x: Any) -> Any:
    """A writable copy (what a caller who builds arrays holds)."""
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else x


def _read_only(x: Any) -> Any:
    """The same values in read-only memory the array does not own, as ``np.frombuffer``,
    ``np.load(mmap_mode="r")``, a PIL image or onnx's own ``to_array`` give."""
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype.hasobject:
        y = x.copy()
    else:
        y = np.frombuffer(x.tobytes(), x.dtype).reshape(x.shape)
    y.flags.writeable = False
    return y


def _strided(x: Any) -> Any:
    """The same values as a non-contiguous view."""
    if not isinstance(x, np.ndarray) or x.ndim == 0 or x.size == 0 or x.dtype == object:
        return x
    return np.repeat(x, 2, axis=-1)[..., ::2]


def _narrowed(x: Any) -> Any:
    """``x`` in a narrower dtype that holds every value exactly (the session widens it
    back), or ``x`` itself."""
    if not isinstance(x, np.ndarray) or x.size == 0:
        return x
    narrower = {
        np.dtype(np.float32): np.float16,
        np.dtype(np.float64): np.float32,
        np.dtype(np.int64): np.int32,
        np.dtype(np.int32): np.int16,
    }.get(x.dtype)
    if narrower is None:
        return x
    with np.errstate(all="ignore"):
        y = x.astype(narrower)
        same = np.array_equal(y.astype(x.dtype), x, equal_nan=x.dtype.kind == "f")
    return y if same else x


def _torch_cpu(x: Any) -> Any:
    """The same values as a CPU torch tensor (read through DLPack), where torch has the
    dtype; else ``x`` itself."""
    import torch

    if not isinstance(x, np.ndarray) or x.dtype.hasobject:
        return x
    name = x.dtype.name
    whole_bytes = name == "bfloat16" or name.startswith("float8")
    target = getattr(torch, name, None) if whole_bytes else None
    if target is not None:  # bfloat16, float8: torch's own type over the same bytes
        carrier = np.int16 if x.dtype.itemsize == 2 else np.uint8
        return torch.from_numpy(np.array(x).view(carrier)).view(target)
    if _lacks_numpy_type(x):
        return x
    try:
        return torch.from_numpy(np.array(x, copy=True))
    except TypeError:  # a dtype torch lacks
        return x


INPUT_WAYS: dict[str, Any] = {
    "writable": _writable,
    "read-only": _read_only,
    "non-contiguous": _strided,
    "narrowed": _narrowed,
    "torch CPU tensor": _torch_cpu,
}
"""How a caller may hold each input; a case passes through xpuruntime only if it passes
in every way, on each engine (``_xrt``)."""


def _xrt(case: Any, engine: str) -> str | None:
    import xpuruntime as xrt

    policy = {"strict": True}
    first = xrt.InferenceSession(case.model, engine=engine, policy=policy)
    first_inputs = data_sets(case)[0][0]
    for way, convert in INPUT_WAYS.items():
        if way != "writable" and all(convert(x) is x for x in first_inputs):
            continue  # this way holds these inputs no differently
        difference = _check(case, first.run, convert)
        if difference is not None:
            return f"inputs {way}: {difference}"
    # A second session: on OpenVINO, the engine the first one stored in the cache.
    second = xrt.InferenceSession(case.model, engine=engine, policy=policy)
    difference = _check(case, second.run, _read_only)
    if difference is not None:
        cache = second.engine_settings.get("engine_cache", "no cache")
        return f"second session ({cache}): {difference}"
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

"""Every bad input gets a clear error in bounded time: FIFOs and devices as paths, YAML
alias bombs, huge values echoed in messages, absurd thread counts."""

from __future__ import annotations

import os
import threading
import time

import pytest

import xpuruntime as xrt


def _within(seconds: float, fn):
    """Run ``fn`` in a thread; fail if it has not finished within ``seconds``."""
    outcome: dict[str, object] = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    started = time.perf_counter()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    outcome["elapsed"] = time.perf_counter() - started
    return outcome


BOMB = """
engine: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
device: [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    outcome = _within(10, lambda: xrt.ExecutionPolicy.load(path))
    error = outcome["error"]
    assert isinstance(error, xrt.PolicyError) and "aliases" in str(error)


def test_a_huge_value_is_not_echoed_whole(tmp_path):
    with pytest.raises(xrt.PolicyError) as raised:
        xrt.ExecutionPolicy(engine="x" * 50_000_000)
    assert len(str(raised.value)) < 5000
    nested = []
    for _ in range(200):
        nested = [nested, nested]  # 2**200 leaves when printed in full
    outcome = _within(10, lambda: xrt.ExecutionPolicy(precision=nested))
    assert isinstance(outcome["error"], xrt.PolicyError)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("reader", ["model", "policy"])
def test_paths_that_are_not_regular_files_are_refused_without_reading(tmp_path, kind, reader):
    if kind == "fifo":
        path = tmp_path / ("p.yaml" if reader == "policy" else "m.onnx")
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    else:
        path = tmp_path / ("d.yaml" if reader == "policy" else "d.onnx")
        path.mkdir()
    if reader == "policy":
        outcome = _within(10, lambda: xrt.ExecutionPolicy.load(path, format="yaml"))
        expected = xrt.PolicyError
    else:
        outcome = _within(10, lambda: xrt.InferenceSession(path, engine="onnxrt"))
        expected = xrt.ModelLoadError
    assert isinstance(outcome["error"], expected), outcome
    assert "not a regular file" in str(outcome["error"])


@pytest.mark.parametrize("threads", [0, 100_000, 2**31, -1, 2.0, True])
def test_thread_counts_are_validated(threads):
    with pytest.raises(xrt.PolicyError, match="threads"):
        xrt.ExecutionPolicy(threads=threads)


def test_a_model_no_engine_can_load_is_a_model_load_error_with_the_backend_chained(tmp_path):
    from conftest import make_model
    from onnx import TensorProto, helper

    # Valid ONNX by the checker (which infers no types), but Relu's output is declared
    # int64, which ONNX Runtime rejects when it builds the session.
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
    )
    with pytest.raises(xrt.ModelLoadError) as raised:
        xrt.InferenceSession(model, engine="onnxrt", policy={"strict": True})
    assert raised.value.__cause__ is not None
    assert "onnxruntime" in type(raised.value.__cause__).__module__


@pytest.mark.parametrize("op", ["custom_domain", "no_kernel_for_type"])
def test_an_op_the_engine_lacks_is_unsupported_naming_op_and_opset(op):
    from onnx import TensorProto, helper

    if op == "custom_domain":
        node = helper.make_node("Foo", ["x"], ["y"], domain="com.example")
        elem, opsets, name = TensorProto.FLOAT, [("", 17), ("com.example", 1)], r"Foo\(-?\d+\)"
    else:
        node = helper.make_node("Identity", ["x"], ["y"])
        elem, opsets, name = TensorProto.INT4, [("", 21)], r"Identity\(\d+\)"
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, [2])],
        [helper.make_tensor_value_info("y", elem, [2])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10
    )
    with pytest.raises(xrt.UnsupportedOperationError, match=name) as raised:
        xrt.InferenceSession(model, engine="onnxrt", policy={"strict": True})
    assert raised.value.__cause__ is not None

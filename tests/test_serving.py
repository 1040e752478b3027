"""Inference scale-out on Ray: a Serve deployment (handle and HTTP) and a Ray Data
predictor on a local two-CPU cluster, each against a single session's outputs.

Marked ``ray``: where Ray cannot start here, the tests are skipped and say why."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install xpuruntime[ray])")

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one cluster, one worker

MODEL = str(demo_model_path())


@pytest.fixture(scope="module")
def cluster():
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # no shared memory, no ports: say so and skip
        pytest.skip(f"Ray cannot start a local cluster here: {type(e).__name__}: {e}")
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _reference(x: np.ndarray) -> np.ndarray:
    return xrt.InferenceSession(MODEL, engine="onnxrt").run({"image": x})[0]


def test_serve_deployment_answers_through_its_handle_and_http(cluster):
    from ray import serve

    from xpuruntime.serving import deployment

    app = deployment(MODEL, engine="onnxrt", num_replicas=2, num_cpus=0.5, max_batch_size=8)
    handle = serve.run(app, name="xrt-test", route_prefix="/xrt-test")
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, 3, 32, 32), np.float32) for n in (1, 3, 2, 4)]
    responses = [handle.predict.remote({"image": x}) for x in xs]  # batched by serve.batch
    for x, response in zip(xs, responses):
        np.testing.assert_array_equal(response.result()["probabilities"], _reference(x))
    decision = handle.decision.remote().result()
    assert decision["engine"] == "onnxrt" and decision["source"] == "policy"
    body = json.dumps({"inputs": {"image": xs[1].tolist()}}).encode()
    request = urllib.request.Request(
        "http://127.0.0.1:8000/xrt-test", data=body, headers={"Content-Type": "application/json"}
    )
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    got = np.asarray(answer["outputs"]["probabilities"], np.float32)
    np.testing.assert_allclose(got, _reference(xs[1]), rtol=1e-6, atol=1e-7)
    serve.delete("xrt-test")


def test_ray_data_predictor_matches_one_session_on_thousands_of_rows(cluster):
    from xpuruntime.serving import Predictor

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    images = np.random.default_rng(1).standard_normal((3000, 3, 32, 32)).astype(np.float32)
    dataset = ray.data.from_numpy(images).map_batches(
        Predictor,
        fn_constructor_kwargs={"model": MODEL, "engine": "onnxrt", "columns": {"image": "data"}},
        concurrency=2,
        num_cpus=0.5,
        batch_size=256,
        batch_format="numpy",
    )
    rows = [b["probabilities"] for b in dataset.iter_batches(batch_size=None, batch_format="numpy")]
    np.testing.assert_array_equal(np.concatenate(rows), _reference(images))


def test_a_batch_without_the_models_column_says_which():
    from xpuruntime.serving import Predictor

    predictor = Predictor(MODEL, engine="onnxrt")
    with pytest.raises(xrt.InvalidInputError, match="lacks column"):
        predictor({"data": np.zeros((1, 3, 32, 32), np.float32)})
    assert predictor.decision["engine"] == "onnxrt"


def test_serving_is_import_light():
    import subprocess
    import sys

    code = "import sys, xpuruntime.serving; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_a_replica_serving_a_model_that_declares_batch_1_answers_each_request_of_a_batch():
    """Ray Serve hands a replica several requests at once; a model exported with batch 1
    refuses them joined, and each runs alone (the batch failed as a whole before)."""
    from onnx import TensorProto, helper, numpy_helper

    from xpuruntime.serving._serve import SessionServer

    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "batch1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    server = SessionServer(model.SerializeToString(), engine="onnxrt")
    requests = [{"x": np.full((1, 8), i, np.float32)} for i in range(3)]
    answers = server.run_batch(requests)
    for request, answer in zip(requests, answers):
        np.testing.assert_array_equal(answer["y"], request["x"] @ w)


def _served(nodes, inputs, outputs, initializers=()):
    from onnx import helper

    from xpuruntime.serving._serve import SessionServer

    graph = helper.make_graph(nodes, "served", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return SessionServer(model.SerializeToString(), engine="onnxrt")


def test_a_replica_joins_requests_only_once_joined_outputs_match_each_request_alone():
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    server = _served(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(w, "w")],
    )
    rng = np.random.default_rng(1)
    for _ in range(3):
        requests = [{"x": rng.standard_normal((n, 8)).astype(np.float32)} for n in (1, 3, 2)]
        for request, answer in zip(requests, server.run_batch(requests)):
            np.testing.assert_allclose(answer["y"], request["x"] @ w, rtol=1e-5, atol=1e-6)
    assert list(server.decision["joined_requests"].values()) == [
        "joined (checked against each request alone)"
    ]


def test_a_replica_answers_each_request_alone_where_the_model_mixes_the_rows_of_a_batch():
    # The mean over the first axis: joined, each request would get the batch's mean.
    from onnx import TensorProto, helper

    server = _served(
        [helper.make_node("ReduceMean", ["x"], ["y"], axes=[0], keepdims=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    rng = np.random.default_rng(2)
    for _ in range(3):
        requests = [{"x": rng.standard_normal((2, 4)).astype(np.float32)} for _ in range(3)]
        for request, answer in zip(requests, server.run_batch(requests)):
            np.testing.assert_allclose(answer["y"], request["x"].mean(0, keepdims=True), rtol=1e-6)
    (why,) = server.decision["joined_requests"].values()
    assert "not each request's alone" in why

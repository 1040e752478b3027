"""The QNN engine for real: Qualcomm's HTP backend from onnxruntime-qnn, in emulation on
x86_64 Linux (a Snapdragon NPU elsewhere), with the placement of every node as proof."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import make_model
from onnx import TensorProto, helper, numpy_helper

import xpuruntime as xrt

pytest.importorskip("onnxruntime_qnn")

STRICT = {"strict": True}


@pytest.fixture(scope="module")
def mlp_relu() -> bytes:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32), np.float32) * 0.3, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8), np.float32) * 0.3, "w2")
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("MatMul", ["a", "w2"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [w1, w2],
    )


def _raw_placement(model: bytes, feeds: dict) -> list[tuple[str, str]]:
    """ONNX Runtime's own report, from a session made with the plugin API directly."""
    import onnxruntime as ort

    from xpuruntime.engines.qnn import qnn_devices

    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if "image" in feeds:
        options.add_free_dimension_override_by_name("batch", feeds["image"].shape[0])
    options.add_provider_for_devices(qnn_devices(), {"backend_type": "htp"})
    session = ort.InferenceSession(model, options)
    return sorted(
        (sub.ep_name, f"{node.domain}:{node.op_type}" if node.domain else node.op_type)
        for sub in session.get_provider_graph_assignment_info()
        for node in sub.get_nodes()
    )


@pytest.mark.parametrize("which", ["mlp", "conv"])
def test_fp32_models_run_on_qnn_and_match_onnxruntime_cpu(mlp_relu, conv_model, which):
    model = mlp_relu if which == "mlp" else conv_model
    shape = (4, 16) if which == "mlp" else (2, 3, 32, 32)
    x = np.random.default_rng(1).standard_normal(shape, np.float32)
    feeds = {"x" if which == "mlp" else "image": x}
    session = xrt.InferenceSession(
        model,
        engine="qnn",
        device="npu",
        policy={**STRICT, "accuracy": {"rtol": 1e-2, "atol": 1e-3}},
        sample_inputs=feeds,  # fixes the conv net's batch: QNN compiles static shapes
    )
    reference = xrt.InferenceSession(model, engine="onnxrt").run(feeds)[0]
    np.testing.assert_allclose(session.run(feeds)[0], reference, rtol=1e-2, atol=1e-3)
    # Every node on QNN, as ORT itself reports it; emulation said as such.
    placement = session._engine.placement
    assert placement.off_target == ()
    ours = sorted((ep, op) for ep, _, op in placement.nodes)
    assert ours == _raw_placement(model, feeds)
    assert "not an NPU" in session.engine_settings["device"]
    assert "QNNExecutionProvider" in session.explain()
    assert "accuracy gate passed" in session.decision.reason


def test_a_qdq_model_matches_the_cpu_ep_within_one_quantization_step(mlp_relu):
    rng = np.random.default_rng(2)
    calibration = [{"x": rng.standard_normal((4, 16), np.float32)} for _ in range(16)]
    session = xrt.InferenceSession(
        mlp_relu,
        engine="qnn",
        device="npu",
        policy={**STRICT, "precision": "int8", "accuracy": {}},
        calibration_inputs=calibration,
        sample_inputs=calibration[0],
    )
    assert "one output quantization step" in session.decision.reason
    step = session._engine._step
    # The same QDQ model on ONNX Runtime's CPU EP.
    cpu = xrt.InferenceSession(session._engine.reference_model, engine="onnxrt")
    for feeds in calibration[:4]:
        np.testing.assert_allclose(
            session.run(feeds)[0], cpu.run(feeds)[0], rtol=0, atol=step * 1.001
        )
    again = xrt.InferenceSession(
        mlp_relu,
        engine="qnn",
        device="npu",
        policy={**STRICT, "precision": "int8"},
        calibration_inputs=calibration,
    )
    assert again.engine_settings["engine_cache"].startswith("hit")  # quantized and compiled once


def _with_det() -> bytes:
    return make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )


def test_an_op_qnn_lacks_is_an_error_when_strict_naming_it():
    with pytest.raises(xrt.XpuRuntimeError, match="Det"):
        xrt.InferenceSession(_with_det(), engine="qnn", device="npu", policy=STRICT)


def test_partial_placement_is_reported_and_warned_when_not_strict():
    with pytest.warns(xrt.FallbackWarning, match=r"1 of 2 nodes run off QNNExecutionProvider.*Det"):
        session = xrt.InferenceSession(_with_det(), engine="qnn", device="npu")
    assert session.engine == "qnn"
    placement = session.engine_settings["placement"]
    assert "QNNExecutionProvider 1 of 2 nodes (Relu)" in placement
    assert "CPUExecutionProvider 1 node (Det)" in placement
    x = np.diag([1.0, 2.0, 3.0]).astype(np.float32)
    assert float(session.run({"x": x})[0]) == pytest.approx(6.0)


def test_compiled_qnn_contexts_round_trip_through_the_engine_cache(mlp_relu):
    x = {"x": np.random.default_rng(3).standard_normal((4, 16), np.float32)}
    first = xrt.InferenceSession(mlp_relu, engine="qnn", device="npu", policy=STRICT)
    assert first.engine_settings["engine_cache"].startswith("stored")
    second = xrt.InferenceSession(mlp_relu, engine="qnn", device="npu", policy=STRICT)
    assert second.engine_settings["engine_cache"].startswith("hit")
    assert "EPContext" in second.engine_settings["placement"]
    np.testing.assert_array_equal(first.run(x)[0], second.run(x)[0])


def test_a_dynamic_model_without_sample_inputs_is_refused_with_the_reason(conv_model):
    with pytest.raises(xrt.UnsupportedOperationError, match=r"image\[0\] \('batch'\)"):
        xrt.InferenceSession(conv_model, engine="qnn", device="npu", policy=STRICT)


def test_without_onnxruntime_qnn_the_engine_says_what_to_install(mlp_relu, tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(mlp_relu)
    code = (
        "import sys; sys.modules['onnxruntime_qnn'] = None\n"
        "import xpuruntime as xrt\n"
        "try:\n"
        f"    xrt.InferenceSession({str(model)!r}, engine='qnn', device='npu', policy={{'strict': True}})\n"
        "except xrt.BackendUnavailableError as e:\n"
        "    print('unavailable:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "unavailable:" in done.stdout and "pip install xpuruntime[qnn]" in done.stdout, done


def test_the_dispatch_log_carries_the_placement(mlp_relu):
    xrt.enable_dispatch_logging()
    try:
        xrt.InferenceSession(mlp_relu, engine="qnn", device="npu", policy={"accuracy": {}})
    finally:
        xrt.disable_dispatch_logging()
    record = [r for r in xrt.get_dispatch_logs() if r.op == "engine"][-1]
    assert record.chosen == "qnn"
    assert "placement: QNNExecutionProvider 3 of 3 nodes" in record.reason

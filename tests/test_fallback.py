"""No silently wrong fallback: an engine nobody asked for is checked against another
engine before it serves, or its results are said to be unverified."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import xpuruntime as xrt

pytest.importorskip("openvino")


def test_a_fallback_engine_is_checked_against_another_engine(mlp_model):
    # TensorRT cannot run on the CPU: the session falls back to ONNX Runtime, whose
    # results are checked against OpenVINO before it serves.
    with pytest.warns(xrt.FallbackWarning, match="accuracy gate passed against openvino"):
        session = xrt.InferenceSession(mlp_model, engine="tensorrt", device="cpu")
    assert session.decision.source == "fallback"
    assert "accuracy gate passed against openvino" in session.decision.reason


def _topk_uint64() -> bytes:
    """TopK(24) on uint64: ONNX Runtime 1.32 has no kernel for it; OpenVINO runs it."""
    k = helper.make_tensor("k", TensorProto.INT64, [1], [2])
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT64, [2, 4])],
        [
            helper.make_tensor_value_info("values", TensorProto.UINT64, [2, 2]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 2]),
        ],
        [k],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)
    return model.SerializeToString()


@pytest.mark.parametrize("with_samples", [False, True])
def test_a_fallback_nothing_can_check_is_said_to_be_unverified(with_samples):
    x = np.array([[1, 9, 3, 7], [8, 2, 6, 4]], np.uint64)
    samples = {"x": x} if with_samples else None
    with pytest.warns(xrt.FallbackWarning, match="results unverified"):
        session = xrt.InferenceSession(_topk_uint64(), engine="onnxrt", sample_inputs=samples)
    assert session.engine == "openvino"
    why = "no other engine could run" if with_samples else "no sample inputs"
    assert why in session.decision.reason
    values, indices = session.run({"x": x})
    np.testing.assert_array_equal(values, [[9, 7], [8, 6]])
    np.testing.assert_array_equal(indices, [[1, 3], [0, 2]])


def test_best_performance_never_fails_a_session_an_engine_can_run():
    # Reflect padding needs each padded axis to have length >= 2; inputs generated from
    # the metadata give dynamic dims 1, so every timing run fails there.
    pads = helper.make_tensor("pads", TensorProto.INT64, [4], [0, 1, 0, 1])
    graph = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "w2"])],
        [pads],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    session = xrt.InferenceSession(model, policy={"auto_strategy": "best_performance"})
    assert "no timing run succeeded" in session.decision.reason
    assert "sample_inputs" in session.decision.reason
    x = np.array([[1, 2, 3]], np.float32)
    np.testing.assert_array_equal(session.run({"x": x})[0], [[2, 1, 2, 3, 2]])
    measured = xrt.InferenceSession(
        model, policy={"auto_strategy": "best_performance"}, sample_inputs={"x": x}
    )
    assert "fastest when measured" in measured.decision.reason

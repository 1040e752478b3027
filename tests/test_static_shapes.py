"""OpenVINO compiles a model whose inputs have dynamic dimensions again for each input
shape it runs (``static_shapes``, on by default), as ``benchmark_app -shape`` does: the
outputs of the dynamic model within fp32 rounding, the same on every run of a shape."""

import importlib.util
import logging
import sys
import threading

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper

import xpuruntime as xrt
from xpuruntime import PolicyError
from xpuruntime.engines import openvino as ov_engine

pytest.importorskip("openvino")


def _feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)}


def _mlp_float64(model: bytes, x: np.ndarray) -> np.ndarray:
    """The mlp fixture's model in float64, from its own weights."""
    weights = {
        t.name: onnx.numpy_helper.to_array(t)
        for t in onnx.load_from_string(model).graph.initializer
    }
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    hidden = np.maximum(x.astype(np.float64) @ w["w1"] + w["b1"], 0)
    return hidden @ w["w2"] + w["b2"]


def test_each_shape_runs_on_a_model_compiled_for_it_and_gives_the_same_outputs_every_run(
    mlp_model,
):
    feeds = _feeds(3)
    want = _mlp_float64(mlp_model, feeds["x"])
    with xrt.InferenceSession(mlp_model, engine="openvino") as session:
        assert session.engine_settings["static_shapes"] == "for each input shape, up to 8"
        outs = [session.run(feeds)[0] for _ in range(3)]
        settings = session.engine_settings
    assert (
        settings["static_shapes"]
        == "for each input shape, up to 8; compiled for 3x16 (1 stream(s))"
    )
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_shapes_past_the_limit_run_on_the_dynamic_model(mlp_model, monkeypatch):
    monkeypatch.setattr(ov_engine, "_STATIC_SHAPES", 2)
    with xrt.InferenceSession(mlp_model, engine="openvino") as session:
        for batch in (1, 2, 5, 1, 2, 5):
            feeds = _feeds(batch, seed=batch)
            np.testing.assert_allclose(
                session.run(feeds)[0], _mlp_float64(mlp_model, feeds["x"]), rtol=1e-5, atol=1e-5
            )
        line = session.engine_settings["static_shapes"]
    assert line == (
        "for each input shape, up to 2; compiled for 1x16 (1 stream(s)), 2x16 (1 stream(s))"
    )


def test_a_model_too_large_to_keep_a_copy_for_checking_shapes_still_runs_its_static_forms(
    mlp_model, monkeypatch
):
    monkeypatch.setattr(ov_engine, "_SHAPE_CHECK_BYTES", 0)  # every model is "too large"
    feeds = _feeds(3)
    with xrt.InferenceSession(mlp_model, engine="openvino") as session:
        out = session.run(feeds)[0]
        assert session.engine_settings["static_shapes"].endswith("compiled for 3x16 (1 stream(s))")
    np.testing.assert_allclose(out, _mlp_float64(mlp_model, feeds["x"]), rtol=1e-5, atol=1e-5)


def test_threads_meeting_a_new_shape_at_once_compile_it_once_and_get_the_same_outputs(
    mlp_model,
):
    inputs = [_feeds(7, seed=i) for i in range(8)]
    wants = [_mlp_float64(mlp_model, f["x"]) for f in inputs]
    failures, got = [], {}
    with xrt.InferenceSession(mlp_model, engine="openvino") as session:
        start = threading.Barrier(4)

        def work(offset: int) -> None:
            start.wait()
            for i in range(40):
                k = (i + offset) % len(inputs)
                out = session.run(inputs[k])[0]
                if not np.allclose(out, wants[k], rtol=1e-5, atol=1e-5):
                    failures.append(k)
                got.setdefault(k, out)
                if not np.array_equal(out, got[k]):  # one compiled model runs the shape
                    failures.append(("differs", k))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        line = session.engine_settings["static_shapes"]
    assert failures == []
    assert line.endswith("compiled for 7x16 (1 stream(s))")


def test_a_shape_that_cannot_be_compiled_for_runs_on_the_dynamic_model_and_is_not_tried_again(
    mlp_model, monkeypatch, caplog
):
    calls = []

    def refuse(self, shapes):
        calls.append(shapes)
        raise RuntimeError("no static form today")

    monkeypatch.setattr(ov_engine.OpenVinoEngine, "_compile_static", refuse)
    feeds = _feeds(4)
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        with xrt.InferenceSession(mlp_model, engine="openvino") as session:
            outs = [session.run(feeds)[0] for _ in range(4)]
            line = session.engine_settings["static_shapes"]
    assert len(calls) == 1 and line == "for each input shape, up to 8"
    assert "could not compile the model for input shapes {'x': (4, 16)}" in caplog.text
    for out in outs:
        np.testing.assert_allclose(out, _mlp_float64(mlp_model, feeds["x"]), rtol=1e-5, atol=1e-5)


def test_the_policy_turns_it_off_and_fixed_shapes_do_not_need_it(mlp_model):
    policy = xrt.ExecutionPolicy(engine="openvino", static_shapes=False)
    assert xrt.ExecutionPolicy.from_dict(policy.to_dict()) == policy
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        for _ in range(3):
            session.run(_feeds(3))
        assert session.engine_settings["static_shapes"] == "off (policy static_shapes=False)"
    fixed = make_model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    with xrt.InferenceSession(fixed, engine="openvino") as session:
        assert session.engine_settings["static_shapes"].startswith("not needed")
    with pytest.raises(PolicyError, match="static_shapes: expected True or False"):
        xrt.ExecutionPolicy(static_shapes="yes")


@pytest.mark.parametrize(
    "quantizer",
    [
        pytest.param(
            "nncf",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("nncf") is None, reason="NNCF is not installed"
            ),
        ),
        "onnxrt",
    ],
)
def test_int8_models_compile_for_their_shapes_after_an_engine_cache_reload_too(
    quantizer, monkeypatch, tmp_path
):
    """The int8 form runs compiled for the shape (NNCF's model or the QDQ model), near
    its dynamic form; a second session reading the compiled model from the engine cache
    compiles for the shape from the IR stored beside it, to the same outputs."""
    from test_int8 import _batches, _conv_net

    if quantizer == "onnxrt":
        monkeypatch.setitem(sys.modules, "nncf", None)  # as if not installed
    model = _conv_net()
    calibration, held = _batches(10), _batches(1, seed=99)[0]
    policy = {"engine": "openvino", "precision": "int8", "strict": True, "cache_dir": str(tmp_path)}
    states, outs = [], []
    for _ in range(2):
        with xrt.InferenceSession(model, policy=policy, calibration_inputs=calibration) as session:
            outs.append(session.run(held)[0])
            settings = session.engine_settings
            policy_off = {**policy, "static_shapes": False}
        assert settings["precision"].startswith("int8 by ")
        assert settings["static_shapes"].endswith("compiled for 4x3x32x32 (1 stream(s))")
        states.append(settings["engine_cache"])
    assert states[0].startswith("stored") and states[1].startswith("hit")
    np.testing.assert_array_equal(outs[1], outs[0])
    with xrt.InferenceSession(model, policy=policy_off, calibration_inputs=calibration) as session:
        dynamic = session.run(held)[0]
    np.testing.assert_allclose(outs[0], dynamic, rtol=1e-5, atol=1e-5)


def test_a_model_of_several_inputs_names_each_shape_it_was_compiled_for(two_input_model):
    feeds = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "ids": np.arange(9, dtype=np.int64).reshape(3, 3),
    }
    with xrt.InferenceSession(two_input_model, engine="openvino") as session:
        out = session.run(feeds)[0]
        line = session.engine_settings["static_shapes"]
    np.testing.assert_array_equal(out, feeds["a"] * 36)
    assert line.endswith("compiled for a=3x4 ids=3x3 (1 stream(s))")


def test_the_sample_inputs_shape_is_compiled_for_when_the_session_loads(mlp_model):
    feeds = _feeds(6)
    with xrt.InferenceSession(mlp_model, engine="openvino", sample_inputs=feeds) as session:
        line = session.engine_settings["static_shapes"]
        out = session.run(feeds)[0]
    assert line.endswith("compiled for 6x16 (1 stream(s))")
    np.testing.assert_allclose(out, _mlp_float64(mlp_model, feeds["x"]), rtol=1e-5, atol=1e-5)

import threading
import warnings

import numpy as np
import pytest

import xpuruntime as xrt

ENGINES = ["onnxrt", "openvino"]


def reference_mlp(model_bytes, x):
    import onnx
    from onnx import numpy_helper

    weights = {
        t.name: numpy_helper.to_array(t)
        for t in onnx.load_from_string(model_bytes).graph.initializer
    }
    h = np.maximum(x.astype(np.float64) @ weights["w1"] + weights["b1"], 0)
    return h @ weights["w2"] + weights["b2"]


@pytest.mark.parametrize("engine", ENGINES)
def test_mlp_matches_a_float64_reference_on_each_engine(mlp_model, engine):
    x = np.random.default_rng().standard_normal((5, 16)).astype(np.float32)
    with xrt.InferenceSession(mlp_model, engine=engine) as session:
        (y,) = session.run({"x": x})
        assert session.engine == engine and session.decision.source == "policy"
    ref = reference_mlp(mlp_model, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("engine", ENGINES)
def test_dynamic_batch_runs_at_several_sizes(mlp_model, engine):
    session = xrt.InferenceSession(mlp_model, engine=engine)
    for batch in (1, 7, 64):
        (y,) = session.run([np.random.default_rng(batch).standard_normal((batch, 16), np.float32)])
        assert y.shape == (batch, 8)


def test_metadata_has_symbolic_dims_and_dtypes(two_input_model):
    session = xrt.InferenceSession(two_input_model)
    a, ids = session.inputs
    assert (a.name, a.shape, a.dtype) == ("a", ("batch", 4), np.dtype(np.float32))
    assert (ids.name, ids.shape, ids.dtype) == ("ids", ("batch", 3), np.dtype(np.int64))
    assert session.outputs[0].shape == ("batch", 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_conv_net_outputs_are_probabilities(conv_model, engine):
    session = xrt.InferenceSession(conv_model, engine=engine)
    (p,) = session.run(
        {"image": np.random.default_rng().standard_normal((3, 3, 32, 32), np.float32)}
    )
    assert p.shape == (3, 10) and np.allclose(p.sum(axis=1), 1, atol=1e-5)


def test_auto_on_cpu_prefers_onnxruntime_and_explains_why(mlp_model):
    session = xrt.InferenceSession(mlp_model)
    assert session.engine == "onnxrt" and session.decision.source == "auto"
    text = session.explain()
    assert "onnxrt" in text and "CPUExecutionProvider" in text


def test_policy_dict_and_argument_overrides(mlp_model):
    session = xrt.InferenceSession(
        mlp_model, engine="openvino", policy={"engine": "onnxrt", "threads": 1}
    )
    assert session.engine == "openvino" and session.policy.threads == 1
    assert session.policy.engine == "openvino"


def test_openvino_fp32_policy_sets_the_f32_precision_hint(conv_model):
    session = xrt.InferenceSession(conv_model, engine="openvino", policy={"precision": "fp32"})
    assert session.engine_settings["inference_precision"] == "f32"


def test_onnxruntime_rejects_bf16_precision_with_a_reason(mlp_model):
    with pytest.raises(xrt.UnsupportedOperationError, match="bfloat16"):
        xrt.InferenceSession(
            mlp_model, engine="onnxrt", policy={"precision": "bf16", "strict": True}
        )


def test_onnxruntime_fp16_precision_converts_the_model_and_keeps_float32_io(mlp_model):
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    reference = xrt.InferenceSession(mlp_model, engine="onnxrt").run({"x": x})[0]
    session = xrt.InferenceSession(
        mlp_model, engine="onnxrt", policy={"precision": "fp16", "strict": True}
    )
    (y,) = session.run({"x": x})
    assert y.dtype == np.float32
    assert "fp16 (model converted" in session.engine_settings["precision"]
    rel = np.linalg.norm(y - reference) / np.linalg.norm(reference)
    assert 1e-5 < rel < 5e-3  # really computed in float16: close, but not bit-equal


def test_unsupported_engine_falls_back_with_warning_or_raises_when_strict(mlp_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = xrt.InferenceSession(mlp_model, engine="tensorrt")
    assert session.decision.source == "fallback" and session.engine == "onnxrt"
    assert dict(session.decision.rejected)["tensorrt"]
    assert any(issubclass(w.category, xrt.FallbackWarning) for w in caught)
    with pytest.raises(xrt.UnsupportedOperationError, match="tensorrt"):
        xrt.InferenceSession(mlp_model, engine="tensorrt", policy={"strict": True})


def test_tensorrt_and_qnn_say_what_is_missing(mlp_model):
    from xpuruntime.engines import QnnEngine, TensorRTEngine

    with pytest.raises(
        (xrt.BackendUnavailableError, xrt.UnsupportedOperationError),
        match="QNNExecutionProvider|onnxruntime-qnn|npu",
    ):
        xrt.InferenceSession(mlp_model, device="npu", engine="qnn", policy={"strict": True})
    ctx = _ctx(mlp_model, "cuda:0")
    support = TensorRTEngine.supports(ctx)
    assert not support.ok and ("libnvinfer" in support.reason or "cuda" in support.reason)
    assert not QnnEngine.supports(_ctx(mlp_model, "npu")).ok


def _ctx(model, device):
    from xpuruntime.engines import EngineContext
    from xpuruntime.inference import Model

    return EngineContext(Model.load(model), xrt.Device(device), xrt.ExecutionPolicy(device=device))


def test_missing_cuda_device_raises_cuda_error(mlp_model):
    with pytest.raises(xrt.CudaError):
        xrt.InferenceSession(mlp_model, device=f"cuda:{xrt.get_device_count('cuda')}")


def test_best_performance_measures_engines_and_caches_the_result(mlp_model, tmp_path):
    policy = {"auto_strategy": "best_performance", "cache_dir": str(tmp_path)}
    first = xrt.InferenceSession(mlp_model, policy=policy)
    assert set(first.decision.measurements) == set(ENGINES)
    assert first.engine == min(first.decision.measurements, key=first.decision.measurements.get)
    second = xrt.InferenceSession(mlp_model, policy=policy)
    assert "cached" in second.decision.reason and second.engine == first.engine
    assert list((tmp_path / "engine-selection").glob("*.json"))


def test_accuracy_gate_passes_good_engines(conv_model):
    session = xrt.InferenceSession(
        conv_model, engine="openvino", policy={"accuracy": {"rtol": 1e-4, "atol": 1e-5}}
    )
    assert session.engine == "openvino" and "accuracy gate passed" in session.decision.reason


def test_accuracy_gate_skips_or_raises_for_an_engine_that_misses_it(conv_model):
    # atol=0, rtol=0 demands bit-identical outputs: OpenVINO's kernels differ from ORT's
    # in the last bits, so it fails the gate and the session falls back to ONNX Runtime.
    gate = {"rtol": 0.0, "atol": 0.0}
    feeds = {"image": np.random.default_rng(0).standard_normal((4, 3, 32, 32), np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xrt.FallbackWarning)
        session = xrt.InferenceSession(
            conv_model, engine="openvino", policy={"accuracy": gate}, sample_inputs=feeds
        )
    reason = dict(session.decision.rejected).get("openvino", "")
    if not reason:
        pytest.skip("OpenVINO matched ONNX Runtime bit for bit on this CPU")
    assert session.engine == "onnxrt" and "accuracy gate failed" in reason
    with pytest.raises(xrt.UnsupportedOperationError, match="accuracy gate failed"):
        xrt.InferenceSession(
            conv_model,
            engine="openvino",
            policy={"accuracy": gate, "strict": True},
            sample_inputs=feeds,
        )


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_runs_from_threads_give_each_caller_its_own_result(mlp_model, engine):
    session = xrt.InferenceSession(mlp_model, engine=engine)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((i + 1, 16)).astype(np.float32) for i in range(16)]
    expected = [session.run({"x": x})[0] for x in inputs]
    errors, mismatches = [], []

    def worker(offset):
        try:
            for round_ in range(25):
                i = (offset + round_) % len(inputs)
                (y,) = session.run({"x": inputs[i]})
                if not np.array_equal(y, expected[i]):
                    mismatches.append(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not mismatches


def test_output_names_select_and_order(mlp_model):
    session = xrt.InferenceSession(mlp_model)
    x = np.ones((2, 16), np.float32)
    assert np.array_equal(session.run({"x": x}, output_names=["y"])[0], session.run({"x": x})[0])
    with pytest.raises(xrt.InvalidInputError, match="unknown output"):
        session.run({"x": x}, output_names=["z"])


def test_closed_session_refuses_to_run(mlp_model):
    session = xrt.InferenceSession(mlp_model)
    session.close()
    with pytest.raises(xrt.InvalidInputError, match="closed"):
        session.run({"x": np.ones((1, 16), np.float32)})

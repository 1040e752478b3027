"""run_many joins consecutive inputs into batches (``request_batch``) only where the
model computes each as it does alone: the results are the inputs' own, in order, on
real models and on models built to mix rows or to refuse a batch."""

import numpy as np
import pytest
from conftest import make_model
from onnx import TensorProto, helper, numpy_helper
from realistic_inputs import speech

import xpuruntime as xrt

ENGINES = ["onnxrt", "openvino"]


def _vad_inputs(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "input": speech(seed + i, 576),
            "state": (rng.standard_normal((2, 1, 128)) * 0.3).astype(np.float32),
        }
        for i in range(count)
    ]


def _assert_alone(session, inputs, results, rtol=1e-4, atol=1e-6):
    assert len(results) == len(inputs)
    for feeds, got in zip(inputs, results):
        for g, w in zip(got, session.run(feeds)):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("engine", ENGINES)
def test_silero_vad_chunks_run_joined_on_their_batch_axes_with_each_chunks_own_results(
    silero_vad_model, engine
):
    """The state joins on axis 1, the audio on axis 0; the model declares batch 1 (a
    fixed shape)."""
    inputs = _vad_inputs(70)
    policy = {"engine": engine, "performance": "throughput", "request_batch": 16}
    with xrt.InferenceSession(silero_vad_model, policy=policy, strict=True) as session:
        results = list(session.run_many(inputs))
        _assert_alone(session, inputs, results)
        assert "input=1x576 state=2x1x128: 16 inputs a batch" in session.explain()
        assert results[20][1].shape == (2, 1, 128) and results[20][1].flags.c_contiguous


def test_auto_joins_a_fast_model_under_throughput_and_nothing_under_latency(silero_vad_model):
    inputs = _vad_inputs(200, seed=3)
    for performance, joined in (("throughput", True), ("latency", False)):
        policy = {"engine": "openvino", "performance": performance}
        with xrt.InferenceSession(silero_vad_model, policy=policy) as session:
            _assert_alone(session, inputs, list(session.run_many(inputs)))
            text = session.explain()
            # VAD computes an input in about 80 us alone on an idle core; on a machine
            # busy enough that it measures longer than Python feeds the requests, auto
            # runs it alone and says so (the choice is timed: it is not asserted here).
            timed_out = "longer than Python takes to feed" in text
            assert ("inputs a batch" in text) is joined or (joined and timed_out), text


def test_a_model_that_mixes_rows_runs_every_input_alone(two_input_model):
    """out = a * (the sum of every id in the batch): joined, each input's result would
    change. The first batch's check finds it and says so."""
    rng = np.random.default_rng(0)
    inputs = [
        {
            "a": rng.standard_normal((1, 4)).astype(np.float32),
            "ids": rng.integers(0, 9, (1, 3)),
        }
        for _ in range(20)
    ]
    for engine in ENGINES:
        policy = {"engine": engine, "request_batch": 4}
        with xrt.InferenceSession(two_input_model, policy=policy, strict=True) as session:
            _assert_alone(session, inputs, list(session.run_many(inputs)), rtol=0, atol=0)
            assert "a=1x4 ids=1x3: alone (output 0 of the batch" in session.explain()


def _fixed_batch_model(reshaped: bool = False) -> bytes:
    """x[1, 8] -> tanh(x @ w) [1, 8]: its batch declared 1, as exported models often do;
    ``reshaped``: with a Reshape to [1, 8] inside, which no batch can pass."""
    w = numpy_helper.from_array(
        np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32), "w"
    )
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])]
    shape = numpy_helper.from_array(np.array([1, 8], np.int64), "shape")
    if reshaped:
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["r"]),
            helper.make_node("Tanh", ["r"], ["y"]),
        ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [w, shape] if reshaped else [w],
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_declaring_batch_1_runs_joined_batches_on_either_engine(engine):
    """OpenVINO compiles it again for the batch; ONNX Runtime, which refuses any other
    size for a declared dimension, runs it with that dimension left free."""
    rng = np.random.default_rng(1)
    inputs = [{"x": rng.standard_normal((1, 8)).astype(np.float32)} for _ in range(12)]
    policy = {"engine": engine, "request_batch": 4}
    with xrt.InferenceSession(_fixed_batch_model(), policy=policy, strict=True) as session:
        _assert_alone(session, inputs, list(session.run_many(inputs)))
        assert "x=1x8: 4 inputs a batch" in session.explain()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_that_cannot_run_a_batch_runs_inputs_alone_and_says_why(engine):
    rng = np.random.default_rng(1)
    inputs = [{"x": rng.standard_normal((1, 8)).astype(np.float32)} for _ in range(12)]
    policy = {"engine": engine, "request_batch": 4}
    model = _fixed_batch_model(reshaped=True)
    with xrt.InferenceSession(model, policy=policy, strict=True) as session:
        _assert_alone(session, inputs, list(session.run_many(inputs)))
        assert "x=1x8: alone (the engine cannot run the batch" in session.explain()


def test_identical_inputs_wait_for_inputs_that_differ_before_a_batch_is_trusted(mlp_model):
    same = {"x": np.ones((2, 16), np.float32)}
    differing = [{"x": np.full((2, 16), i, np.float32)} for i in range(8)]
    policy = {"engine": "openvino", "request_batch": 4}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        _assert_alone(session, [same] * 8, list(session.run_many([same] * 8)))
        assert "inputs a batch" not in session.explain()
        _assert_alone(session, differing, list(session.run_many(differing)))
        assert "x=2x16: 4 inputs a batch" in session.explain()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bad_input_among_joined_ones_fails_at_its_turn_after_the_results_before_it(
    mlp_model, engine
):
    rng = np.random.default_rng(4)
    good = [{"x": rng.standard_normal((2, 16)).astype(np.float32)} for _ in range(13)]
    bad = {"x": np.ones((2, 16, 3), np.float32)}  # wrong rank
    policy = {"engine": engine, "request_batch": 4}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        list(session.run_many(good[:8]))  # the first batch is checked and trusted
        stream = session.run_many([*good[:10], bad, *good[10:]])
        _assert_alone(session, good[:10], [next(stream) for _ in range(10)])
        with pytest.raises(xrt.InvalidInputError, match="rank"):
            next(stream)
        # The session serves the next stream as before.
        _assert_alone(session, good, list(session.run_many(good)))


def test_a_buffer_the_caller_refills_between_inputs_is_read_as_it_was_when_yielded(mlp_model):
    rng = np.random.default_rng(5)
    values = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(24)]
    buffer = np.empty((2, 16), np.float32)

    def refilled():
        for value in values:
            buffer[...] = value
            yield {"x": buffer}

    policy = {"engine": "openvino", "request_batch": 8}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        results = list(session.run_many(refilled()))
        _assert_alone(session, [{"x": v} for v in values], results)
        assert "8 inputs a batch" in session.explain()
        # Joined inputs are copied into their batch even when not copied otherwise.
        results = list(session.run_many(refilled(), copy_inputs=False))
        _assert_alone(session, [{"x": v} for v in values], results)


def test_inputs_of_other_shapes_or_other_unjoined_values_are_never_joined_together():
    """y = x * s: x joins on its batch axis; s (a scalar) cannot, so a batch holds
    inputs that agree on it; a shape change ends the batch being gathered."""
    model = make_model(
        [helper.make_node("Mul", ["x", "s"], ["y"])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
    rng = np.random.default_rng(6)
    inputs = [
        {
            "x": rng.standard_normal((1 + i % 3 // 2, 3)).astype(np.float32),
            "s": np.array(1.0 + i % 2, np.float32),
        }
        for i in range(60)
    ]
    for engine in ENGINES:
        policy = {"engine": engine, "request_batch": 2}
        with xrt.InferenceSession(model, policy=policy, strict=True) as session:
            _assert_alone(session, inputs, list(session.run_many(inputs)), rtol=0, atol=0)
            # Consecutive inputs in this stream never share both shape and s.
            assert "inputs a batch" not in session.explain()
            same_s = [{**feeds, "s": np.array(2.0, np.float32)} for feeds in inputs]
            sorted_s = sorted(same_s, key=lambda feeds: feeds["x"].shape)
            _assert_alone(session, sorted_s, list(session.run_many(sorted_s)), rtol=0, atol=0)
            assert "x=1x3: 2 inputs a batch" in session.explain()


def test_two_threads_streaming_through_one_session_each_get_their_own_results(silero_vad_model):
    import threading

    streams = [_vad_inputs(90, seed=s) for s in (10, 500)]
    results: dict[int, list] = {}
    policy = {"engine": "openvino", "performance": "throughput", "request_batch": 8}
    with xrt.InferenceSession(silero_vad_model, policy=policy) as session:

        def consume(index: int) -> None:
            results[index] = list(session.run_many(streams[index]))

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for index, inputs in enumerate(streams):
            _assert_alone(session, inputs, results[index])
        assert "8 inputs a batch" in session.explain()


def test_an_input_failing_while_its_batch_is_checked_fails_at_its_turn():
    """ids out of the table's range: ONNX Runtime's Gather fails at run time, on an
    input that passed validation, in the first batch (the one checked against alone)."""
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    model = make_model(
        [helper.make_node("Gather", ["table", "ids"], ["rows"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 4])],
        [table],
    )
    good = [{"ids": np.array([i % 10], np.int64)} for i in range(12)]
    bad = {"ids": np.array([99], np.int64)}
    policy = {"engine": "onnxrt", "request_batch": 4}
    with xrt.InferenceSession(model, policy=policy, strict=True) as session:
        stream = session.run_many([good[0], good[1], bad, *good[2:]])
        _assert_alone(session, good[:2], [next(stream), next(stream)], rtol=0, atol=0)
        with pytest.raises(xrt.XpuRuntimeError):
            next(stream)
        _assert_alone(session, good, list(session.run_many(good)), rtol=0, atol=0)
        assert "ids=1: 4 inputs a batch" in session.explain()


@pytest.mark.parametrize("engine", ENGINES)
def test_joined_inputs_held_read_only_or_broadcast_give_the_outputs_asked_for(
    silero_vad_model, engine
):
    """Audio from a read-only buffer, a state broadcast from one row (how a caller starts
    every stream at zero), and only the state asked for."""
    rng = np.random.default_rng(7)
    inputs = []
    for i in range(40):
        audio = np.frombuffer(speech(i, 576).tobytes(), np.float32).reshape(1, 576)
        state = np.broadcast_to(
            (rng.standard_normal((1, 1, 128)) * 0.3).astype(np.float32), (2, 1, 128)
        )
        inputs.append({"input": audio, "state": state})
    assert not inputs[0]["input"].flags.writeable and inputs[0]["state"].strides[0] == 0
    policy = {"engine": engine, "performance": "throughput", "request_batch": 8}
    with xrt.InferenceSession(silero_vad_model, policy=policy, strict=True) as session:
        results = list(session.run_many(inputs, output_names=["stateN"]))
        assert all(len(r) == 1 and r[0].shape == (2, 1, 128) for r in results)
        for feeds, (state,) in zip(inputs, results):
            np.testing.assert_allclose(
                state, session.run(feeds, ["stateN"])[0], rtol=1e-4, atol=1e-6
            )
        assert "8 inputs a batch" in session.explain()

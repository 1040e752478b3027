"""threads='auto': a CPU engine times fewer intra-op threads against its default on the
sample inputs, keeps the fastest, and says what it timed; where it cannot or need not
measure, the engine's default stands, said why."""

import numpy as np
import pytest

import xpuruntime as xrt
from xpuruntime.engines import _threads
from xpuruntime.runtime._discovery import usable_cores

ENGINES = ["onnxrt", "openvino"]
THREADS_KEY = {"onnxrt": "intra_op_threads", "openvino": "threads"}


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((4, 16)).astype(np.float32)}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tiny_model_is_timed_on_fewer_threads_and_runs_on_the_count_it_names(mlp_model, engine):
    policy = {"engine": engine, "threads": "auto", "strict": True}
    with xrt.InferenceSession(mlp_model, policy=policy, sample_inputs=_feeds()) as session:
        settings = session.engine_settings
        line, chosen = settings["threads_auto"], settings[THREADS_KEY[engine]]
        outputs = session.run(_feeds(1))
    with xrt.InferenceSession(mlp_model, engine=engine) as default:
        expected = default.run(_feeds(1))
    if usable_cores() == 1:
        assert chosen is None and "one core" in line
    else:
        # Every count below the cores is timed against the default.
        assert "default: " in line and "1: " in line and " ms" in line
        if chosen is None:
            assert line.startswith(f"{engine}'s default (auto: no fewer threads ran")
        else:
            assert line.startswith(f"{chosen} (auto: ") and chosen < usable_cores()
    np.testing.assert_allclose(outputs[0], expected[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_whose_call_takes_long_enough_keeps_the_engines_threads(
    mlp_model, engine, monkeypatch
):
    monkeypatch.setattr(_threads, "TUNED_BELOW_S", 0.0)  # every call counts as long
    policy = {"engine": engine, "threads": "auto"}
    with xrt.InferenceSession(mlp_model, policy=policy, sample_inputs=_feeds()) as session:
        settings = session.engine_settings
    assert settings[THREADS_KEY[engine]] is None
    assert "long enough for its threads to pay off" in settings["threads_auto"]


@pytest.mark.parametrize("engine", ENGINES)
def test_throughput_mode_keeps_the_engines_split_of_the_cores(mlp_model, engine):
    policy = {"engine": engine, "threads": "auto", "performance": "throughput"}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        line = session.engine_settings["threads_auto"]
        assert "performance='throughput'" in line
        assert len(list(session.run_many([_feeds(i) for i in range(6)]))) == 6


@pytest.mark.parametrize("engine", ENGINES)
def test_inputs_it_cannot_make_up_leave_the_default_and_say_why(two_input_model, engine):
    """No sample inputs and an int64 input: nothing is generated to time with."""
    with xrt.InferenceSession(two_input_model, policy={"engine": engine, "threads": "auto"}) as s:
        line = s.engine_settings["threads_auto"]
        out = s.run({"a": np.ones((2, 4), np.float32), "ids": np.ones((2, 3), np.int64)})
    assert line.startswith(f"{engine}'s default (auto: not measured:") and "'ids'" in line
    np.testing.assert_array_equal(out[0], np.full((2, 4), 6.0, np.float32))


def test_the_policy_takes_auto_saves_it_and_names_it_in_its_error():
    policy = xrt.ExecutionPolicy(threads="auto")
    assert xrt.ExecutionPolicy.from_dict(policy.to_dict()).threads == "auto"
    for bad in ("Auto", "fast", 0, True, 2.0):
        with pytest.raises(xrt.PolicyError, match="threads: expected an int from 1 to .*'auto'"):
            xrt.ExecutionPolicy(threads=bad)


def test_counts_tried_are_powers_of_two_below_the_cores():
    assert _threads.counts_below(1) == []
    assert _threads.counts_below(2) == [1]
    assert _threads.counts_below(16) == [1, 2, 4, 8]
    assert _threads.counts_below(12) == [1, 2, 4, 8]

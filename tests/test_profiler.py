"""The Profiler: ranges from user code, sessions and the dispatcher in one Chrome trace."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import xpuruntime as xrt


@pytest.fixture
def profiler():
    prof = xrt.Profiler.instance()
    prof.clear()
    prof.enable()
    yield prof
    prof.disable()
    prof.clear()


def test_ranges_nest_and_export_as_a_chrome_trace(profiler, tmp_path):
    with profiler.range("outer", batch=8):
        profiler.push_range("inner", "user", step=1)
        assert profiler.pop_range() >= 0.0
    path = profiler.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    outer, inner = spans["outer"], spans["inner"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert outer["args"] == {"batch": 8} and inner["args"] == {"step": 1}
    assert profiler.summary()["outer"]["count"] == 1


def test_pop_without_a_range_is_an_error(profiler):
    with pytest.raises(xrt.InvalidInputError, match="no range is open"):
        profiler.pop_range()


def test_nothing_is_recorded_while_disabled(profiler):
    profiler.disable()
    with profiler.range("ignored"):
        profiler.instant("ignored too")
    assert profiler.events == []


def test_each_thread_keeps_its_own_range_stack(profiler):
    barrier = threading.Barrier(4)

    def work(name):
        with profiler.range(name):
            barrier.wait()  # all four alive at once, so no thread id is reused

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tids = {e["tid"] for e in profiler.events if e["name"].startswith("t")}
    assert len(tids) == 4


def test_sessions_and_engine_decisions_report_into_the_profiler(profiler, mlp_model):
    session = xrt.InferenceSession(mlp_model, engine="onnxrt")
    session.run({"x": np.ones((2, 16), np.float32)})
    names = [e["name"] for e in profiler.events]
    assert "session.load" in names
    assert "engine.build onnxrt" in names
    assert "decide engine: onnxrt" in names
    assert "session.run onnxrt" in names
    decision = next(e for e in profiler.events if e["name"] == "decide engine: onnxrt")
    assert decision["ph"] == "i" and decision["args"]["source"] == "policy"

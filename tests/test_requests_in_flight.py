"""performance='throughput', run_async and run_many: requests in flight on both CPU
engines, in order, bounded, each failing on its own."""

import threading
from concurrent.futures import CancelledError, Future

import numpy as np
import pytest

import xpuruntime as xrt

ENGINES = ["onnxrt", "openvino"]


def _batches(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((2, 16)).astype(np.float32)} for _ in range(count)]


@pytest.mark.parametrize("performance", ["latency", "throughput"])
@pytest.mark.parametrize("engine", ENGINES)
def test_run_many_yields_every_result_in_input_order(mlp_model, engine, performance):
    policy = {"engine": engine, "performance": performance, "strict": True}
    batches = _batches(25)
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        expected = [session.run(feeds) for feeds in batches]
        results = list(session.run_many(iter(batches)))  # a one-pass iterable
        line = session.engine_settings["performance"]
        assert line.startswith(performance)
        if performance == "throughput":
            assert session.max_pending >= 2
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_request_fails_its_own_future_only(mlp_model, engine):
    """OpenVINO's AsyncInferQueue would raise the first failure again from every later
    request; ours must not."""
    good = _batches(6)
    bad = {"x": np.ones((2, 16, 3), np.float32)}  # wrong rank
    with xrt.InferenceSession(mlp_model, engine=engine, policy={"performance": "throughput"}) as s:
        futures = [s.run_async(good[0]), s.run_async(bad), *(s.run_async(f) for f in good[1:])]
        assert isinstance(futures[0], Future)
        with pytest.raises(xrt.InvalidInputError, match="rank"):
            futures[1].result(timeout=30)
        outputs = [f.result(timeout=30) for f in futures[:1] + futures[2:]]
        for feeds, out in zip(good, outputs):
            np.testing.assert_array_equal(out[0], s.run(feeds)[0])
        # run_many stops at the failure, after the results before it.
        stream = s.run_many([good[0], good[1], bad, good[2]])
        assert len(next(stream)) == 1 and len(next(stream)) == 1
        with pytest.raises(xrt.InvalidInputError):
            next(stream)


def test_inputs_are_copied_at_submission(mlp_model):
    with xrt.InferenceSession(mlp_model, engine="onnxrt") as session:
        buffer = _batches(1)[0]["x"]
        expected = session.run({"x": buffer.copy()})[0]
        futures = []
        for _ in range(8):
            futures.append(session.run_async({"x": buffer}))
            buffer[:] = np.nan  # the caller reuses its buffer at once
        np.testing.assert_array_equal(futures[0].result(timeout=30)[0], expected)


@pytest.mark.parametrize("engine", ENGINES)
def test_inputs_not_copied_on_request_are_read_in_place_and_give_the_same_results(
    mlp_model, engine
):
    """copy_inputs=False: the engine runs the caller's own arrays (a request's copy
    of PP-OCR cls's 884 KB input held a 16-core Xeon to 0.75-0.78x benchmark_app)."""
    batches = _batches(12)
    policy = {"engine": engine, "performance": "throughput", "request_batch": 1}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        expected = [session.run(feeds) for feeds in batches]
        seen = []
        inner = session._engine.run

        def spied(feeds, names, device=None):
            seen.append(feeds["x"])
            return inner(feeds, names, device)

        session._engine.run = spied
        results = list(session.run_many(iter(batches), copy_inputs=False))
        assert [a is b["x"] for a, b in zip(seen, batches)] == [True] * 12
        future = session.run_async(batches[0], copy_inputs=False)
        np.testing.assert_array_equal(future.result(timeout=30)[0], expected[0][0])
        assert seen[-1] is batches[0]["x"]
        seen.clear()
        list(session.run_many(batches[:3]))  # copied by default
        assert not any(a is b["x"] or np.shares_memory(a, b["x"]) for a, b in zip(seen, batches))
        with pytest.raises(xrt.InvalidInputError, match="copy_inputs: expected True or False"):
            list(session.run_many(batches, copy_inputs="no"))
        with pytest.raises(xrt.InvalidInputError, match="copy_inputs"):
            session.run_async(batches[0], copy_inputs=None)
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_submitting_beyond_the_limit_waits_for_a_request_to_finish(mlp_model, engine):
    with xrt.InferenceSession(mlp_model, engine=engine) as session:
        release = threading.Event()
        inner = session._engine.run

        def held_run(feeds, names, output_device=None):  # holds every worker until released
            release.wait(30)
            return inner(feeds, names, output_device)

        session._engine.run = held_run
        feeds = _batches(1)[0]
        futures = [session.run_async(feeds) for _ in range(session.max_pending)]
        extra: list[Future] = []
        submitter = threading.Thread(target=lambda: extra.append(session.run_async(feeds)))
        submitter.start()
        submitter.join(0.5)
        assert submitter.is_alive() and not extra  # waiting: the limit is reached
        release.set()
        submitter.join(30)
        assert len(extra) == 1
        for future in [*futures, *extra]:
            assert len(future.result(timeout=30)) == 1


def test_threads_sharing_a_throughput_session_each_get_their_own_results(mlp_model):
    policy = {"engine": "openvino", "performance": "throughput"}
    with xrt.InferenceSession(mlp_model, policy=policy) as session:
        per_thread = {t: _batches(20, seed=t) for t in range(3)}
        expected = {t: [session.run(f)[0] for f in b] for t, b in per_thread.items()}
        got: dict[int, list[np.ndarray]] = {}

        def consume(t: int) -> None:
            got[t] = [out[0] for out in session.run_many(per_thread[t])]

        threads = [threading.Thread(target=consume, args=(t,)) for t in per_thread]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    for t in per_thread:
        for a, b in zip(got[t], expected[t]):
            np.testing.assert_array_equal(a, b)


def test_closing_finishes_running_requests_cancels_queued_ones_and_refuses_new(mlp_model):
    session = xrt.InferenceSession(mlp_model, engine="onnxrt")
    release = threading.Event()
    inner = session._engine.run
    session._engine.run = lambda feeds, names, device=None: (
        release.wait(30),
        inner(feeds, names, device),
    )[1]
    feeds = _batches(1)[0]
    futures = [session.run_async(feeds) for _ in range(session.max_pending)]
    closer = threading.Thread(target=session.close)
    closer.start()
    release.set()
    closer.join(30)
    finished = [f for f in futures if not f.cancelled()]
    assert finished and all(len(f.result()) == 1 for f in finished)
    for f in futures:
        if f.cancelled():
            with pytest.raises(CancelledError):
                f.result()
    with pytest.raises(xrt.InvalidInputError, match="closed"):
        session.run_async(feeds)


def test_a_session_whose_engine_keeps_more_requests_busy_later_runs_more_at_once(mlp_model):
    """OpenVINO's model compiled for a static shape can keep more requests busy than its
    dynamic one: the session's queue widens, and what the narrower pool had queued runs."""
    with xrt.InferenceSession(mlp_model, engine="onnxrt") as session:  # latency: 1 request
        release, started = threading.Event(), []
        inner = session._engine.run

        def held_run(feeds, names, output_device=None):
            started.append(threading.get_ident())
            release.wait(30)
            return inner(feeds, names, output_device)

        session._engine.run = held_run
        feeds = _batches(1)[0]
        narrow = [session.run_async(feeds) for _ in range(2)]  # one runs, one queued
        session._engine._requests = 3  # as the engine does when it finds more
        wide = [session.run_async(feeds) for _ in range(3)]
        deadline = threading.Event()
        for _ in range(300):
            if len(started) >= 4:
                break
            deadline.wait(0.01)
        assert len(started) == 4  # 1 from the narrow pool, 3 at once in the wide one
        release.set()
        for future in [*narrow, *wide]:
            assert len(future.result(timeout=30)) == 1
        assert session.max_pending == 6

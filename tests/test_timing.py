"""The timing that auto and the benchmarks rely on: time_call and paired comparisons."""

import time

import pytest

torch = pytest.importorskip("torch")

from xpuruntime.pytorch._selection._timing import (  # noqa: E402
    Comparison,
    compare_calls,
    time_call,
    time_training_call,
)


def test_speed_ratio_pairs_rounds_so_a_drift_shared_by_both_cancels():
    # B is 10% faster than A in every round while both slow down 3x over the run:
    # comparing medians across rounds would mix the drift in, pairing does not.
    drift = [1.0, 1.5, 2.0, 2.5, 3.0]
    timed = Comparison({"a": [d * 1.0 for d in drift], "b": [d * 0.9 for d in drift]})
    assert timed.speed_ratio("b", "a") == pytest.approx(1 / 0.9)
    assert timed.speed_ratio("a", "b") == pytest.approx(0.9)
    assert timed.fastest() == "b" and timed.fastest(among=["a"]) == "a"


def test_a_callable_that_refuses_has_no_median_and_is_never_fastest():
    timed = Comparison({"ok": [1.0, 2.0, 3.0], "refused": [None, None, None]})
    assert timed.medians == {"ok": 2.0, "refused": None}
    assert timed.fastest() == "ok"


def test_compare_calls_times_every_callable_in_every_round_and_records_refusals():
    def slow():
        time.sleep(2e-3)

    def refuses():
        raise RuntimeError("this backend does not take the shape")

    timed = compare_calls(
        {"fast": lambda: None, "slow": slow, "refuses": refuses},
        torch.device("cpu"),
        rounds=3,
        min_seconds=0.0,
    )
    assert [len(v) for v in timed.seconds.values()] == [3, 3, 3]
    assert timed.seconds["refuses"] == [None, None, None]
    assert timed.fastest() == "fast" and timed.speed_ratio("fast", "slow") > 10


def test_time_call_measures_at_least_the_work_done():
    seconds = time_call(lambda: time.sleep(1e-3), torch.device("cpu"), min_seconds=0.01)
    assert 1e-3 <= seconds < 0.1


def test_a_training_call_of_several_outputs_is_timed_with_the_backward_of_each():
    """An op that returns several tensors (q/k/v projections, a residual and its norm)
    is used whole by a model: timing the backward of one output alone would spare the
    kernel that makes them separately the others' backward."""
    x = torch.randn(8, 16, requires_grad=True)
    weights = [torch.randn(16, 4, requires_grad=True) for _ in range(3)]
    reached = []
    for w in weights:
        w.register_hook(lambda g, w=w: reached.append(id(w)) or g)

    def run():
        return tuple(x @ w for w in weights)

    time_training_call(run, [x, *weights], torch.device("cpu"), backward=True)
    assert {id(w) for w in weights} == set(reached)
    assert all(t.grad is None for t in (x, *weights))  # cleared after each call

import json
import warnings

import pytest

import xpuruntime as xrt
from xpuruntime.kernels import Dispatcher, DispatchLog, KernelRegistry, MeasurementCache, Support
from xpuruntime.kernels._dispatcher import MEASURE_ROUNDS


class Kernel:
    def __init__(self, name, ok=True, reason="", missing=False, seconds=1.0):
        self.name, self._ok, self._reason, self._missing = name, ok, reason, missing
        self.seconds, self.measured = seconds, 0

    def supports(self, ctx):
        if self._ok:
            return Support.yes(f"{self.name} ok")
        return Support.unavailable(self._reason) if self._missing else Support.no(self._reason)


def make(*kernels):
    registry = KernelRegistry()
    for kernel in kernels:
        registry.register("matmul", kernel)
    return Dispatcher(registry, DispatchLog())


def test_policy_choice_is_honoured_when_supported():
    d = make(Kernel("a"), Kernel("b"))
    decision = d.select("matmul", None, requested="b")
    assert (decision.chosen, decision.source, decision.rejected) == ("b", "policy", ())


def test_auto_takes_first_supported_and_records_rejections():
    d = make(Kernel("a", ok=False, reason="needs sm80"), Kernel("b"), Kernel("c"))
    decision = d.select("matmul", None)
    assert decision.chosen == "b" and decision.source == "auto"
    assert decision.rejected == (("a", "needs sm80"),)
    assert "needs sm80" in decision.explain()


def test_unsupported_policy_choice_falls_back_with_one_warning_per_reason():
    d = make(Kernel("a", ok=False, reason="fp32 inputs"), Kernel("b"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = d.select("matmul", None, requested="a")
        d.select("matmul", None, requested="a")
    assert (first.chosen, first.source) == ("b", "fallback")
    fallbacks = [w for w in caught if issubclass(w.category, xrt.FallbackWarning)]
    assert len(fallbacks) == 1 and "fp32 inputs" in str(fallbacks[0].message)


def test_strict_mode_raises_with_reasons_instead_of_falling_back():
    d = make(Kernel("a", ok=False, reason="fp32 inputs"), Kernel("b"))
    with pytest.raises(xrt.UnsupportedOperationError, match="fp32 inputs") as info:
        d.select("matmul", None, requested="a", strict=True)
    assert info.value.rejected == (("a", "fp32 inputs"),)


def test_strict_mode_with_missing_library_raises_backend_unavailable():
    d = make(Kernel("a", ok=False, reason="pip install thing", missing=True), Kernel("b"))
    with pytest.raises(xrt.BackendUnavailableError, match="pip install thing"):
        d.select("matmul", None, requested="a", strict=True)


def test_nothing_supported_lists_every_reason():
    d = make(Kernel("a", ok=False, reason="r1"), Kernel("b", ok=False, reason="r2"))
    with pytest.raises(xrt.UnsupportedOperationError, match="a: r1; b: r2"):
        d.select("matmul", None)


def test_unknown_requested_candidate_is_a_policy_error_listing_choices():
    d = make(Kernel("a"))
    with pytest.raises(xrt.PolicyError, match=r"\['a', 'auto'\]"):
        d.select("matmul", None, requested="zzz")


def test_accept_hook_can_reject_a_supported_candidate():
    d = make(Kernel("a"), Kernel("b"))
    decision = d.select(
        "matmul", None, accept=lambda k: Support.no("too slow") if k.name == "a" else Support.yes()
    )
    assert decision.chosen == "b" and decision.rejected == (("a", "too slow"),)


def test_best_performance_measures_in_interleaved_rounds_once_then_uses_the_disk_cache(
    tmp_path,
):
    a, b = Kernel("a", seconds=2.0), Kernel("b", seconds=1.0)
    order = []

    def measure(k):
        k.measured += 1
        order.append(k.name)
        return k.seconds + (5.0 if k.measured == 1 else 0.0)  # a slow first round

    cache = MeasurementCache(tmp_path)
    for _ in range(2):
        decision = make(a, b).select(
            "matmul",
            None,
            strategy="best_performance",
            measure=measure,
            cache=cache,
            cache_key="shape-class-1",
        )
        assert decision.chosen == "b" and decision.measurements == {"a": 2.0, "b": 1.0}
    # Measured only the first time, in interleaved rounds of alternating order.
    rounds = [["a", "b"] if r % 2 == 0 else ["b", "a"] for r in range(MEASURE_ROUNDS)]
    assert order == [name for names in rounds for name in names]
    assert "cached" in decision.reason


@pytest.mark.parametrize(
    ("rounds_b", "chosen", "said"),
    [
        ([0.97] * MEASURE_ROUNDS, "a", "the default, kept: b ran 1.03x its speed"),
        ([0.80, 1.10, 1.20, 1.30], "a", "within the 1.38x"),  # faster once, noisy
        ([0.80, 0.81, 0.80, 0.82], "b", "1.25x the speed of the default a (needed 1.05x)"),
        # A loaded machine: rounds over twice apart, but 100 times faster.
        ([0.01, 0.025, 0.03, 0.03], "b", "100.00x the speed of the default a"),
        ([1.30] * MEASURE_ROUNDS, "a", "fastest when measured"),
    ],
)
def test_best_performance_keeps_the_default_unless_another_wins_beyond_the_spread(
    tmp_path, rounds_b, chosen, said
):
    """The default is what first_supported picks (the first supported candidate); a
    measured choice that loses to it in the step is worse than not measuring, so another
    wins only by more than AUTO_MARGIN and more than the spread of its best rounds."""
    a, b = Kernel("a"), Kernel("b")

    def measure(k):
        k.measured += 1
        return 1.0 if k is a else rounds_b[k.measured - 1]

    cache = MeasurementCache(tmp_path)
    for _ in range(2):  # measured, then from the disk cache: the same choice and reason
        decision = make(a, b).select(
            "matmul", None, strategy="best_performance", measure=measure, cache=cache,
            cache_key="k",
        )  # fmt: skip
        assert decision.chosen == chosen and said in decision.reason, decision.reason
    assert b.measured == MEASURE_ROUNDS


def test_corrupted_measurement_cache_entry_is_discarded_and_remeasured(tmp_path):
    cache = MeasurementCache(tmp_path)
    cache.put("k", {"a": 1.0})
    entry = next(tmp_path.glob("*.json"))
    entry.write_text("{not json")
    assert cache.get("k") is None and not entry.exists()


def test_dispatch_log_records_only_when_enabled_and_exports_json(tmp_path):
    d = make(Kernel("a", ok=False, reason="no"), Kernel("b"))
    d.select("matmul", None)
    assert d.log.records == []
    d.log.enable()
    d.select("matmul", None)
    (record,) = d.log.records
    assert (record.op, record.chosen, record.source) == ("matmul", "b", "auto")
    assert record.rejected == (("a", "no"),) and record.elapsed_s >= 0
    exported = json.loads(d.log.export_json(tmp_path / "log.json").read_text())
    assert exported[0]["chosen"] == "b"
    d.log.clear()
    assert d.log.records == []


def test_registry_rejects_duplicates_and_malformed_candidates():
    registry = KernelRegistry()
    registry.register("op", Kernel("a"))
    with pytest.raises(xrt.PolicyError, match="already registered"):
        registry.register("op", Kernel("a"))
    with pytest.raises(xrt.PolicyError, match="supports"):
        registry.register("op", object())


def test_session_decisions_go_to_the_global_dispatch_log(mlp_model):
    xrt.clear_dispatch_logs()
    xrt.enable_dispatch_logging()
    try:
        xrt.InferenceSession(mlp_model, engine="openvino")
    finally:
        xrt.disable_dispatch_logging()
    records = [r for r in xrt.get_dispatch_logs() if r.op == "engine"]
    assert records[-1].chosen == "openvino" and records[-1].context["device"] == "cpu"
    xrt.clear_dispatch_logs()


def test_best_performance_measures_again_where_noise_alone_keeps_the_default(tmp_path):
    """A busy machine: b's rounds lie far apart (spread over NOISY_SPREAD) though it ran
    faster than the margin asks; rather than keep the default for the noise, the
    candidates are measured again, and b wins once its rounds agree."""
    a, b = Kernel("a"), Kernel("b")
    noisy = [0.5, 1.6, 1.6, 1.6]  # twice as fast once, its best two rounds 3.2x apart

    def measure(k):
        k.measured += 1
        if k is a:
            return 1.0
        return noisy[k.measured - 1] if k.measured <= len(noisy) else 0.5

    decision = make(a, b).select("matmul", None, strategy="best_performance", measure=measure)
    assert decision.chosen == "b", decision.reason
    assert b.measured == 2 * MEASURE_ROUNDS

"""xpuruntime.pytorch on the CPU: policy API, kernels' reasons, strict/fallback, logs,
autocast, profile. GPU proofs are in test_pytorch_gpu.py."""

import json
import subprocess
import sys
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.kernels import FallbackWarning  # noqa: E402
from xpuruntime.pytorch._kernels._switches import Switches  # noqa: E402

cpu_only_torch = pytest.mark.skipif(
    torch.version.cuda is not None, reason="checks the answer of a CPU-only torch build"
)


@pytest.fixture(autouse=True)
def _clean_state():
    before = Switches.capture()
    yield
    xpt.disable_dispatch_logging()
    xpt.clear_dispatch_logs()
    xpt.clear_kernel_policy()
    assert Switches.capture() == before


def qkv(b=2, h=4, s=37, d=64, kv_heads=None, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    shapes = [(b, h, s, d), (b, kv_heads or h, s, d), (b, kv_heads or h, s, d)]
    return [torch.randn(*sh, generator=g, dtype=dtype).requires_grad_(grad) for sh in shapes]


def reference_attention(q, k, v, mask=None, causal=False):
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    return scores.softmax(-1) @ v


def test_import_without_torch_says_what_to_install():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'): raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import xpuruntime as xrt\n"
        "try:\n"
        "    import xpuruntime.pytorch\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "xpuruntime.pytorch requires PyTorch. Install with: pip install xpuruntime[torch]"
    )


def test_set_get_clear_and_unknown_names_list_the_choices():
    assert xpt.get_kernel_policy() is None
    applied = xpt.set_kernel_policy(attention="math", conv="default")
    assert xpt.get_kernel_policy() == applied
    assert applied.preferences == {"attention": "math", "conv": "default"}
    with pytest.raises(
        xrt.PolicyError, match=r"'flash_v2', 'cudnn', 'flash_v4', 'efficient', 'triton', 'math'"
    ):
        xpt.set_kernel_policy(attention="flash3")
    with pytest.raises(xrt.PolicyError, match=r"expected one of \['matmul', 'attention'"):
        xpt.set_kernel_policy(softmax="fast")
    assert xpt.get_kernel_policy() == applied  # a rejected policy changes nothing
    xpt.clear_kernel_policy()
    assert xpt.get_kernel_policy() is None


def test_policy_file_and_kernel_policy_object_are_accepted(tmp_path):
    path = xrt.KernelPolicy(attention="math", deterministic=True).save(tmp_path / "p.yaml")
    applied = xpt.set_kernel_policy(path, strict=True)
    assert (applied.get("attention"), applied.deterministic, applied.strict) == ("math", True, True)


def test_kernel_policy_block_restores_every_switch_even_on_error():
    before = Switches.capture()
    with pytest.raises(RuntimeError, match="boom"):
        with xpt.kernel_policy(attention="math", deterministic=True, tf32=True, strict=True):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
            raise RuntimeError("boom")
    assert Switches.capture() == before
    assert xpt.get_kernel_policy() is None


def test_nested_blocks_restore_the_outer_policy():
    with xpt.kernel_policy(attention="math"):
        with xpt.kernel_policy(attention="flash_v2", strict=True):
            assert xpt.get_kernel_policy().get("attention") == "flash_v2"
        assert xpt.get_kernel_policy().preferences == {"attention": "math"}
        assert not xpt.get_kernel_policy().strict


def test_policy_is_process_wide_across_threads_and_a_clash_is_warned():
    seen = []
    with pytest.warns(RuntimeWarning, match="changed inside a kernel_policy block"):
        with xpt.kernel_policy(attention="math"):
            other = threading.Thread(target=lambda: seen.append(xpt.get_kernel_policy()))
            other.start()
            other.join()
            clash = threading.Thread(target=lambda: xpt.set_kernel_policy(attention="flash_v2"))
            clash.start()
            clash.join()
    assert seen[0].get("attention") == "math"
    assert xpt.get_kernel_policy() is None


def test_deterministic_says_what_it_turned_off():
    xpt.set_kernel_policy(deterministic=True)
    text = xpt.explain_kernel_policy()
    assert "deterministic: turned off" in text and "cuDNN attention" in text
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_cudnn_attention_under_determinism_is_refused_when_strict():
    with pytest.raises(xrt.UnsupportedOperationError, match="backward is not deterministic"):
        xpt.set_kernel_policy(attention="cudnn", deterministic=True, strict=True)
    assert xpt.get_kernel_policy() is None and not torch.are_deterministic_algorithms_enabled()
    with pytest.warns(FallbackWarning, match="leaves the cuDNN backend off"):
        xpt.set_kernel_policy(attention="cudnn", deterministic=True)


@cpu_only_torch
def test_cuda_kernels_on_a_cpu_build_say_what_is_missing():
    with pytest.raises(xrt.BackendUnavailableError, match="has no CUDA.*install a CUDA build"):
        xpt.set_kernel_policy(matmul="cublasLt", strict=True)
    with pytest.warns(FallbackWarning, match="falling back to 'default'"):
        xpt.set_kernel_policy(matmul="cublasLt")
    assert "matmul: default (fallback; asked: cublasLt" in xpt.explain_kernel_policy()


@pytest.mark.parametrize(
    "kv_heads, causal, mask_kind, dtype, tol",
    [
        (None, False, None, torch.float32, 1e-5),
        (None, True, None, torch.float32, 1e-5),
        (2, True, None, torch.float32, 1e-5),
        (1, False, "bool", torch.float32, 1e-5),
        (None, False, "float", torch.float32, 1e-5),
        (None, True, None, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize("kernel", ["flash_v2", "math", "auto"])
def test_fused_attention_matches_a_float64_reference(
    kv_heads, causal, mask_kind, dtype, tol, kernel
):
    q, k, v = qkv(kv_heads=kv_heads, dtype=dtype, grad=True)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(q.shape[2], k.shape[2]) > 0.3
        mask[:, 0] = True  # no fully masked row
    elif mask_kind == "float":
        mask = torch.randn(q.shape[2], k.shape[2])
    with xpt.kernel_policy(attention=kernel, strict=kernel != "auto"):
        out = xpt.ops.fused_attention(q, k, v, attn_mask=mask, is_causal=causal)
        out.backward(torch.ones_like(out))
    ref = reference_attention(q.detach(), k.detach(), v.detach(), mask, causal)
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < tol
    ref_q = q.detach().double().requires_grad_()
    reference_attention(ref_q, k.detach(), v.detach(), mask, causal).sum().backward()
    assert (q.grad.double() - ref_q.grad).norm() / ref_q.grad.norm() < tol * 10


def test_strict_policy_raises_with_the_reason_and_non_strict_warns_once_and_falls_back():
    q, k, v = qkv()
    with xpt.kernel_policy(attention="flash_v2", strict=True):
        with pytest.raises(xrt.UnsupportedOperationError, match="CPU flash kernel has no dropout"):
            xpt.ops.fused_attention(q, k, v, dropout_p=0.5)
    with xpt.kernel_policy(attention="flash_v2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seq in (37, 41):  # two shape classes, one (op, reason): one warning
                q, k, v = qkv(s=seq)
                torch.manual_seed(0)
                out = xpt.ops.fused_attention(q, k, v, dropout_p=0.5)
        assert [w.category for w in caught] == [FallbackWarning]
        torch.manual_seed(0)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (lambda q, k, v: (q[0], k, v), "query must be a 4-D tensor"),
        (lambda q, k, v: (q, k.double(), v), "must share a dtype"),
        (lambda q, k, v: (q, k[:, :3], v[:, :3]), r"multiple of key/value heads \(3\)"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "same kv_heads and seq_k"),
    ],
)
def test_fused_attention_names_what_is_wrong_with_its_inputs(bad, needle):
    with pytest.raises(xrt.InvalidInputError, match=needle):
        xpt.ops.fused_attention(*bad(*qkv()))


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "logged"])
def test_fused_attention_refuses_a_mismatched_key_or_value_after_a_cached_call(observed):
    # The cached call signature holds the query's dtype only; a key or value of another
    # dtype on a later call must still get our error, not PyTorch's.
    q, k, v = qkv()
    xpt.set_kernel_policy(attention="math")
    if observed:
        xpt.enable_dispatch_logging()
    try:
        xpt.ops.fused_attention(q, k, v)
        for bad in ((q, k.double(), v), (q, k, v.double())):
            with pytest.raises(xrt.InvalidInputError, match="must share a dtype"):
                xpt.ops.fused_attention(*bad)
    finally:
        xpt.disable_dispatch_logging()
        xpt.clear_dispatch_logs()


def _ops_run(fn):
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_runs_the_chosen_backend_and_matches_f_sdpa_bit_for_bit(causal):
    q, k, v = qkv(d=16, grad=True)
    with xpt.kernel_policy(attention="flash_v2", strict=True):
        ran = _ops_run(lambda: xpt.ops.fused_attention(q, k, v, is_causal=causal))
        out = xpt.ops.fused_attention(q, k, v, is_causal=causal)
        out.backward(torch.ones_like(out))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        expected.backward(torch.ones_like(expected))
    assert torch.equal(out, expected)
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


def test_fused_attention_under_autocast_casts_as_f_sdpa_does_after_a_cached_call():
    q, k, v = qkv(d=16)
    with xpt.kernel_policy(attention="flash_v2", strict=True):
        assert xpt.ops.fused_attention(q, k, v).dtype == torch.float32  # now cached
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = xpt.ops.fused_attention(q, k, v)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                expected = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kernel", ["flash_v2", "math", "auto"])
def test_fused_attention_compiles_into_one_graph_running_the_policys_kernel(kernel):
    q, k, v = qkv(d=16, grad=True)
    with xpt.kernel_policy(attention=kernel):
        compiled = torch.compile(xpt.ops.fused_attention, fullgraph=True)
        out = compiled(q, k, v, is_causal=True)
        ran = _ops_run(lambda: compiled(q, k, v, is_causal=True))
        expected = xpt.ops.fused_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    grad = torch.autograd.grad(out.sum(), q)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), q)[0])
    if kernel == "flash_v2":
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
    if kernel == "math":
        assert not any("flash" in name for name in ran), [n for n in ran if "flash" in n]


def test_a_named_kernel_takes_the_short_path_once_a_call_has_resolved_to_it():
    from xpuruntime.pytorch._functional._attention import _attention as routed

    with xpt.kernel_policy(attention="flash_v2"):
        assert routed.short_path is None  # not armed before a call resolved to flash
        xpt.ops.fused_attention(*qkv(s=40, d=16))
        assert routed.short_path == "flash_v2"
        q, k, v = qkv(s=23, d=16)
        ran = _ops_run(lambda: xpt.ops.fused_attention(q, k, v))
        assert len(_attention_decisions()) == 1  # the new shape was not resolved
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            expected = F.scaled_dot_product_attention(q, k, v)
        assert torch.equal(xpt.ops.fused_attention(q, k, v), expected)
    assert routed.short_path is None


@pytest.mark.parametrize("strict", [False, True])
def test_a_call_the_named_kernel_refuses_on_the_short_path_gets_the_policys_answer(strict):
    from xpuruntime.pytorch._functional._attention import _attention as routed

    q, k, v = qkv(d=16)
    with xpt.kernel_policy(attention="flash_v2", strict=strict):
        xpt.ops.fused_attention(q, k, v)  # arms the short path
        assert routed.short_path == "flash_v2"
        if strict:
            with pytest.raises(xrt.UnsupportedOperationError, match="no dropout"):
                xpt.ops.fused_attention(q, k, v, dropout_p=0.5)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch's reasons, and ours (warned once)
            torch.manual_seed(0)
            out = xpt.ops.fused_attention(q, k, v, dropout_p=0.5)
        fallback = [d for d in _attention_decisions() if d.source == "fallback"]
        assert [d.chosen for d in fallback] == ["math"]
        assert routed.short_path is None  # every call is resolved from now on
    torch.manual_seed(0)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out, expected)


def test_dispatch_log_records_the_aten_op_that_ran_forward_and_backward(tmp_path):
    q, k, v = qkv(grad=True)
    xpt.set_kernel_policy(attention="flash_v2", strict=True)
    with pytest.raises(RuntimeError, match="No available kernel"):  # only flash is enabled
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    xpt.set_kernel_policy(attention="flash_v2")
    xpt.enable_dispatch_logging()
    xpt.ops.fused_attention(q, k, v).sum().backward()
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)  # PyTorch falls back to math
    xpt.disable_dispatch_logging()
    q.sum()  # not recorded once disabled
    records = [r for r in xpt.get_dispatch_logs() if "aten_op" in r.context]
    ran = [(r.op, r.chosen, r.source, r.context["aten_op"], r.context["phase"]) for r in records]
    assert ran[:2] == [
        ("attention", "flash_v2", "policy", "_scaled_dot_product_flash_attention_for_cpu", "forward"),
        ("attention", "flash_v2", "policy", "_scaled_dot_product_flash_attention_for_cpu_backward", "backward"),
    ]  # fmt: skip
    fallback = [r for r in records if r.chosen == "math" and r.op == "attention"]
    assert fallback and fallback[0].source == "fallback" and fallback[0].requested == "flash_v2"
    first = records[0]
    assert first.context["shapes"][0] == list(q.shape) and first.context["dtype"] == "float32"
    assert first.context["device"] == "cpu" and first.elapsed_s > 0
    exported = json.loads(xpt.export_dispatch_logs(tmp_path / "log.json").read_text())
    assert len(exported) == len(xpt.get_dispatch_logs())
    xpt.clear_dispatch_logs()
    assert xpt.get_dispatch_logs() == []


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="xpt.autocast picks the CUDA device where there is one"
)
def test_autocast_runs_bf16_on_the_cpu_and_the_log_records_it():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    xpt.enable_dispatch_logging()
    with xpt.autocast(dtype=torch.bfloat16) as region:
        out = a @ b
    assert region.device_type == "cpu" and out.dtype == torch.bfloat16
    (record,) = [r for r in xpt.get_dispatch_logs() if r.op == "matmul"]
    assert record.context["precision"] == "autocast bf16" and record.chosen == "cpu_blas"
    with pytest.raises(xrt.PolicyError, match="expected torch.float16 or torch.bfloat16"):
        xpt.autocast(dtype=torch.float32)


def test_profile_trace_holds_our_ranges_and_the_aten_ops(tmp_path):
    q, k, v = qkv(grad=True)
    path = tmp_path / "trace.json"
    with xpt.profile(export_chrome_trace=path):
        xpt.set_kernel_policy(attention="flash_v2")
        xpt.ops.fused_attention(q, k, v).sum().backward()
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "xrt::attention[flash_v2]" in names and "xrt::resolve attention" in names
    assert any(n.startswith("xrt::set_kernel_policy") for n in names)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names


def test_best_performance_measures_attention_once_per_shape_class_and_caches_on_disk():
    q, k, v = qkv(s=64)
    xpt.set_kernel_policy(auto_strategy="best_performance")
    xpt.ops.fused_attention(q, k, v)
    (first,) = [d for d in _attention_decisions()]
    assert set(first.measurements) == {"flash_v2", "math"} and first.source == "auto"
    xpt.set_kernel_policy(auto_strategy="best_performance")  # new generation, same disk cache
    xpt.ops.fused_attention(*qkv(s=60))  # same shape class (seq bucket 64)
    (second,) = _attention_decisions()
    assert "cached" in second.reason and second.chosen == first.chosen


def test_a_graph_warm_up_makes_measured_decisions_afresh_and_keeps_the_ones_it_makes():
    from xpuruntime.pytorch._selection._policy import by_gpu_time, ranking_by_gpu_time

    q, k, v = qkv(s=64)
    xpt.set_kernel_policy(auto_strategy="best_performance")
    xpt.ops.fused_attention(q, k, v)
    assert len(_attention_decisions()) == 1
    with pytest.raises(RuntimeError), by_gpu_time():
        assert ranking_by_gpu_time() and _attention_decisions() == []  # made afresh for the graph
        xpt.ops.fused_attention(q, k, v)
        raise RuntimeError("a failed warm-up")
    assert not ranking_by_gpu_time() and len(_attention_decisions()) == 1  # kept after the block
    xpt.set_kernel_policy(attention="auto")  # first_supported: nothing is measured
    xpt.ops.fused_attention(q, k, v)
    with by_gpu_time():
        assert len(_attention_decisions()) == 1


def test_a_frozen_policy_runs_the_same_kernels_in_another_process_without_measuring(
    tmp_path, monkeypatch
):
    xpt.set_kernel_policy(auto_strategy="best_performance")
    xpt.ops.fused_attention(*qkv(s=64))
    xpt.ops.fused_attention(*qkv(s=200))
    measured = {d.chosen for d in _attention_decisions()}
    frozen = xpt.freeze_kernel_policy()
    entries = [e for e in frozen.frozen if e["op"] == "attention"]
    assert len(entries) == 2 and {e["kernel"] for e in entries} == measured
    assert all(e["reason"].startswith("best_performance: ") for e in entries)
    assert {e["op"] for e in frozen.frozen} >= {"attention", "matmul", "conv"}
    # What another machine may have measured: the other kernel for the short sequences.
    short = next(e for e in entries if e["shape_class"]["seq_q"] == 64)
    other = ({"flash_v2", "math"} - {short["kernel"]}).pop()
    frozen.freeze("attention", short["shape_class"], other, "measured elsewhere")
    path = frozen.save(tmp_path / "frozen.json")

    xpt.clear_kernel_policy()
    monkeypatch.setenv("XPURUNTIME_CACHE_DIR", str(tmp_path / "fresh"))  # no timings on disk
    xpt.set_kernel_policy(path)
    xpt.ops.fused_attention(*qkv(s=64))
    (decision,) = _attention_decisions()
    assert decision.chosen == other and decision.source == "frozen"
    assert decision.measurements == {} and "measured elsewhere" in decision.reason
    assert f"{other} (frozen): frozen in the policy" in xpt.explain_kernel_policy()
    xpt.ops.fused_attention(*qkv(s=1000))  # a shape class nobody froze: measured
    assert sorted(d.source for d in _attention_decisions()) == ["auto", "frozen"]
    # frozen again: the frozen decision is carried, the new one added
    again = xpt.freeze_kernel_policy()
    assert len([e for e in again.frozen if e["op"] == "attention"]) == 3
    assert again.frozen_for("attention", short["shape_class"])["kernel"] == other


def test_freezing_while_another_thread_meets_new_call_shapes_is_safe():
    xpt.set_kernel_policy(attention="auto")
    errors: list[BaseException] = []
    stop = threading.Event()

    def calls() -> None:
        try:
            for s in range(8, 400):
                if stop.is_set():
                    break
                xpt.ops.fused_attention(*qkv(b=1, h=1, s=s, d=8))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=calls)
    thread.start()
    try:
        frozen = [xpt.freeze_kernel_policy() for _ in range(200)]
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert all(e["op"] in ("attention", "matmul", "conv") for f in frozen for e in f.frozen)


def test_a_kernel_the_policy_names_outranks_a_frozen_one_and_one_that_cannot_run_falls_back():
    q, k, v = qkv(s=64)
    xpt.set_kernel_policy(auto_strategy="best_performance")
    xpt.ops.fused_attention(q, k, v)
    (shape_class,) = [
        e["shape_class"] for e in xpt.freeze_kernel_policy().frozen if e["op"] == "attention"
    ]
    policy = xrt.KernelPolicy(attention="math").freeze("attention", shape_class, "flash_v2")
    xpt.set_kernel_policy(policy)
    xpt.ops.fused_attention(q, k, v)
    assert [(d.chosen, d.source) for d in _attention_decisions()] == [("math", "policy")]
    policy = xrt.KernelPolicy().freeze("attention", shape_class, "cudnn")  # CUDA only
    xpt.set_kernel_policy(policy)
    with pytest.warns(FallbackWarning, match="cudnn"):
        xpt.ops.fused_attention(q, k, v)
    assert [d.source for d in _attention_decisions()] == ["fallback"]
    xpt.set_kernel_policy(policy, strict=True)
    with pytest.raises(xrt.UnsupportedOperationError, match="cudnn"):
        xpt.ops.fused_attention(q, k, v)


def test_measurements_of_graph_replays_are_kept_apart_from_eager_ones():
    from xpuruntime.pytorch._selection._resolution import measurement_key

    device = torch.device("cpu")
    eager = measurement_key("layernorm", device, {"rows": 4096})
    assert eager == measurement_key("layernorm", device, {"rows": 4096}, replayed=False)
    assert eager != measurement_key("layernorm", device, {"rows": 4096}, replayed=True)


def _attention_decisions():
    from xpuruntime.pytorch._functional._attention import _attention

    return list(_attention.decisions.values())


def test_training_under_a_policy_gives_the_same_losses():
    def train(policy):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        data = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
        losses = []
        with xpt.kernel_policy(policy):
            for _ in range(5):
                loss = layer(data).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses

    plain = train(None)
    assert train({"kernels": {"attention": "math", "matmul": "default"}}) == pytest.approx(
        plain, rel=1e-5
    )


@pytest.mark.parametrize(
    "kernel, aten",
    [("math", "_safe_softmax"), ("flash_v2", "_scaled_dot_product_flash_attention_for_cpu")],
)
def test_direct_sdpa_calls_run_the_backend_the_policy_names(kernel, aten):
    q, k, v = qkv()
    xpt.set_kernel_policy(attention=kernel)
    xpt.enable_dispatch_logging()
    F.scaled_dot_product_attention(q, k, v)
    (record,) = [r for r in xpt.get_dispatch_logs() if r.op == "attention"]
    assert (record.chosen, record.source, record.context["aten_op"]) == (kernel, "policy", aten)


def test_an_op_keeps_a_bounded_number_of_resolved_signatures(monkeypatch):
    """Ever-new shapes do not grow a routed op's table without end: past the bound the
    oldest signature is dropped, and resolved again (with the same answer) if it returns."""
    from xpuruntime.pytorch._functional._attention import _attention as routed
    from xpuruntime.pytorch._selection import _routed

    monkeypatch.setattr(_routed, "MAX_SIGNATURES", 3)
    with xpt.kernel_policy(attention="auto"):  # resolved per signature (no short path)
        shapes = [8, 9, 10, 11, 12]
        for s in shapes:
            xpt.ops.fused_attention(*qkv(s=s, d=16))
        kept = [key for key in routed.decisions]
        assert len(kept) == 3
        first = qkv(s=8, d=16)
        torch.testing.assert_close(
            xpt.ops.fused_attention(*first), F.scaled_dot_product_attention(*first)
        )
        assert len(routed.decisions) == 3
        assert len({d.chosen for d in routed.decisions.values()}) == 1

"""attention="flash_v4" on a Hopper or Blackwell GPU with flash-attn-4 installed: FA4 runs
in PyTorch's FLASH backend, its results match a float64 reference, the log names it,
and auto picks it per shape (run by scripts/gpu-check)."""

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.kernels import FallbackWarning, registry  # noqa: E402
from xpuruntime.pytorch._kernels import register_kernels  # noqa: E402
from xpuruntime.pytorch._kernels._switches import flash_impl  # noqa: E402
from xpuruntime.pytorch._kernels.flash_v4 import IMPL  # noqa: E402
from xpuruntime.pytorch._selection._routed import ROUTED_OPS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_kernel_policy")]


@pytest.fixture(autouse=True)
def _fa4_runs_here():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    register_kernels()
    why = registry.get("attention", "flash_v4").unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    yield
    assert flash_impl() is None  # clearing the policy restored FlashAttention-2


def _qkv(b, h, s, d, grad=True):
    g = torch.Generator(device="cuda").manual_seed(s * d)
    return [
        torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
            grad
        )
        for _ in range(3)
    ]


def _reference(q, k, v, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    return out, q64, k64, v64


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_v4_matches_a_float64_reference_forward_and_backward(causal, head_dim):
    q, k, v = _qkv(2, 8, 384, head_dim)
    grad = torch.randn_like(q)
    with xpt.kernel_policy(attention="flash_v4", strict=True):
        assert flash_impl() == IMPL
        out = xpt.ops.fused_attention(q, k, v, is_causal=causal)
        out.backward(grad)
    ref, *leaves = _reference(q, k, v, causal)
    ref.backward(grad.double())
    # bf16 inputs, fp32 accumulation: FlashAttention-2 on the same inputs sets the bar.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        fa2 = F.scaled_dot_product_attention(
            *(t.detach().requires_grad_() for t in (q, k, v)), is_causal=causal
        )
    fa2_error = (fa2.double() - ref).abs().max().item()
    error = (out.double() - ref).abs().max().item()
    print(
        f"D{head_dim} causal={causal}: max |FA4 - fp64| {error:.2e}, |FA2 - fp64| {fa2_error:.2e}"
    )
    assert error <= 2 * fa2_error + 1e-3
    for got, want, name in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves), "qkv"):
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= 0.02 * scale, f"d{name}"


def test_a_flash_v4_policy_runs_fa4_for_fused_attention_and_direct_sdpa_and_the_log_says_so():
    q, k, v = _qkv(2, 8, 512, 128)
    with xpt.kernel_policy(attention="flash_v4", strict=True):
        xpt.enable_dispatch_logging()
        with xpt.profile() as prof:
            xpt.ops.fused_attention(q, k, v, is_causal=True).sum().backward()
            F.scaled_dot_product_attention(q, k, v).sum().backward()
            torch.cuda.synchronize()
        xpt.disable_dispatch_logging()
        records = [
            (r.chosen, r.context["aten_op"], r.context["phase"])
            for r in xpt.get_dispatch_logs()
            if r.op == "attention" and "aten_op" in r.context
        ]
    aten = "_scaled_dot_product_flash_attention"
    assert (
        records
        == [
            ("flash_v4", aten, "forward"),
            ("flash_v4", aten + "_backward", "backward"),
        ]
        * 2
    )
    kernels = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    print("GPU kernels under flash_v4:", kernels)
    assert kernels and not any("pytorch_flash" in n for n in kernels)  # FA2's namespace


def test_a_flash_v4_policy_falls_back_to_flash_v2_where_fa4_refuses_each_call_logging_its_own():
    q, k, v = _qkv(2, 8, 256, 64)
    with xpt.kernel_policy(attention="flash_v4"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        xpt.enable_dispatch_logging()
        for dropout_p in (0.0, 0.1, 0.0, 0.1):  # FA4 has no dropout; FlashAttention-2 has
            xpt.ops.fused_attention(q, k, v, dropout_p=dropout_p).sum().backward()
        torch.cuda.synchronize()
        xpt.disable_dispatch_logging()
        picks = {
            key[6]: (d.chosen, d.source) for key, d in ROUTED_OPS["attention"].decisions.items()
        }
    ran = [
        r.chosen
        for r in xpt.get_dispatch_logs()
        if r.op == "attention" and r.context.get("phase") == "forward" and "aten_op" in r.context
    ]
    assert picks == {0.0: ("flash_v4", "policy"), 0.1: ("flash_v2", "fallback")}
    assert ran == ["flash_v4", "flash_v2", "flash_v4", "flash_v2"]


def test_best_performance_measures_fa4_against_the_others_per_shape_class():
    picks = {}
    with xpt.kernel_policy(auto_strategy="best_performance"):
        for shape in [(16, 12, 1024, 64), (4, 16, 4096, 128)]:
            xpt.ops.fused_attention(*_qkv(*shape), is_causal=True).sum().backward()
        for key, decision in ROUTED_OPS["attention"].decisions.items():
            picks[key[0][-1]] = (decision.chosen, decision.measurements)
    print("best_performance:", picks)
    chosen = [p[0] for p in picks.values()]
    assert all("flash_v4" in p[1] for p in picks.values())
    assert "flash_v4" in chosen

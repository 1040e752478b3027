"""fused_layernorm and fused_rmsnorm against a float64 reference, forward and backward,
on the CPU under TRITON_INTERPRET=1 (and compiled on a GPU), plus their modules and the
policy's layernorm/rmsnorm ops."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops.fused_layernorm import layernorm_backward, layernorm_forward  # noqa: E402
from xpuruntime.pytorch._ops.fused_rmsnorm import rmsnorm_backward, rmsnorm_forward  # noqa: E402
from xpuruntime.pytorch.ops import (  # noqa: E402
    FusedLayerNorm,
    FusedRMSNorm,
    fused_layernorm,
    fused_rmsnorm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, atol, rtol) against float64: bf16/fp16 outputs carry one rounding of the result.
DTYPES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-2, 5e-3),
    (torch.bfloat16, 6e-2, 2e-2),
]
# Widths: 1, primes, non-powers of two, and one past the register path (the looped one).
SHAPES = [(1, 1), (3, 7), (2, 5, 127), (13, 1031), (4, 4096), (3, 20011)]


pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


def _fresh(shape, dtype, grad=True, scale=1.0, shift=0.0):
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE) * scale + shift
    return t.to(dtype).requires_grad_(grad)


def _reference(fn, x, params, grad_out):
    x64 = x.detach().double().requires_grad_()
    p64 = [None if p is None else p.detach().double().requires_grad_() for p in params]
    out = fn(x64, *p64)
    out.backward(grad_out.double())
    return out, x64.grad, [None if p is None else p.grad for p in p64]


def _close(actual, expected, atol, rtol, what):
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=what)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["weight_and_bias", "weight_only", "none"])
def test_fused_layernorm_matches_float64_forward_and_backward(shape, dtype, atol, rtol, affine):
    n = shape[-1]
    x = _fresh(shape, dtype, shift=3.0)  # an offset mean checks the centring
    w = _fresh((n,), dtype) if affine != "none" else None
    b = _fresh((n,), dtype) if affine == "weight_and_bias" else None
    y = fused_layernorm(x, (n,), w, b, eps=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, (dw, db) = _reference(
        lambda x_, w_, b_: F.layer_norm(x_, (n,), w_, b_, 1e-5), x, (w, b), g
    )
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, ref, atol, rtol, "output")
    # Gradients sum over rows and N terms; their tolerance grows with the reduction.
    _close(x.grad, dx, atol * 2, rtol * 2, "input gradient")
    if w is not None:
        _close(w.grad, dw, atol * 4, rtol * 4, "weight gradient")
    if b is not None:
        _close(b.grad, db, atol * 4, rtol * 4, "bias gradient")


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_fused_rmsnorm_matches_float64_forward_and_backward(shape, dtype, atol, rtol, with_weight):
    n = shape[-1]
    x = _fresh(shape, dtype)
    w = _fresh((n,), dtype) if with_weight else None
    y = fused_rmsnorm(x, (n,), w, eps=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, (dw,) = _reference(lambda x_, w_: F.rms_norm(x_, (n,), w_, 1e-6), x, (w,), g)
    _close(y, ref, atol, rtol, "output")
    _close(x.grad, dx, atol * 2, rtol * 2, "input gradient")
    if w is not None:
        _close(w.grad, dw, atol * 4, rtol * 4, "weight gradient")


@pytest.mark.parametrize("n", [257, 20011])
def test_every_output_element_is_written(n):
    """Outputs start as NaN; a kernel that skips an element (a tail, a row) leaves one."""
    m = 9
    x = _fresh((m, n), torch.float32, grad=False)
    w, b, dy = (
        _fresh((n,), torch.float32, False),
        _fresh((n,), torch.float32, False),
        _fresh((m, n), torch.float32, False),
    )
    nan = float("nan")
    y, mean, rstd = torch.full_like(x, nan), x.new_full((m,), nan), x.new_full((m,), nan)
    layernorm_forward(x, w, b, 1e-5, y, mean, rstd)
    dx = torch.full_like(x, nan)
    dw, db = layernorm_backward(dy, x, w, mean, rstd, dx, bias_grad=True)
    for name, t in {"y": y, "mean": mean, "rstd": rstd, "dx": dx, "dw": dw, "db": db}.items():
        assert not t.isnan().any(), f"layernorm left {name} partly unwritten"
    y, rstd, dx = torch.full_like(x, nan), x.new_full((m,), nan), torch.full_like(x, nan)
    rmsnorm_forward(x, w, 1e-6, y, rstd)
    dw = rmsnorm_backward(dy, x, w, rstd, dx)
    for name, t in {"y": y, "rstd": rstd, "dx": dx, "dw": dw}.items():
        assert not t.isnan().any(), f"rmsnorm left {name} partly unwritten"


def test_multi_dim_normalized_shape_and_non_contiguous_input():
    leaf = _fresh((6, 4, 10), torch.float32)
    x = leaf.transpose(0, 1)  # (4, 6, 10), not contiguous
    x.retain_grad()
    w, b = _fresh((6, 10), torch.float32), _fresh((6, 10), torch.float32)
    y = fused_layernorm(x, (6, 10), w, b)
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, (dw, _) = _reference(
        lambda x_, w_, b_: F.layer_norm(x_, (6, 10), w_, b_), x, (w, b), g
    )
    _close(y, ref, 1e-5, 1e-5, "output")
    _close(x.grad, dx, 2e-5, 2e-5, "input gradient")
    _close(w.grad, dw, 4e-5, 4e-5, "weight gradient")


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(("heads", "others", "grad"), [(4, 4, True), (1, 2, True), (3, 2, False)])
@pytest.mark.parametrize("transposed", [False, True])
def test_rmsnorm_of_a_per_head_view_of_wider_rows_reads_it_in_place(
    dtype, atol, rtol, heads, others, grad, transposed
):
    # Qwen3's q/k norms take (B, T, heads, D) views of one projection of q, k and v (the
    # heads of a token D apart, tokens a whole joined row apart), Gemma3's the same after
    # attention's transpose, (B, heads, T, D). The
    # norm reads them where they lie (no copy of the view first); what the backward keeps
    # is a dense copy the forward kernel wrote as it read (not the view, which would keep
    # all of the joined tensor alive); it agrees with float64, and the input gradient
    # reaches the joined tensor through the view.
    from torch.utils._python_dispatch import TorchDispatchMode

    from xpuruntime.pytorch._ops._infra._rows import as_grouped_rows

    b, t, d = 2, 5, 16
    joined = _fresh((b, t, (heads + others) * d), dtype, grad=grad)
    q = joined[..., : heads * d].view(b, t, heads, d)
    if transposed:
        q = q.transpose(1, 2)
    w = _fresh((d,), dtype, grad=grad)
    rows = as_grouped_rows(q, d)
    grouped = (b * t, heads, d)
    if transposed:  # one head: the tokens alone are the groups' rows
        grouped = (b * heads, t, d) if heads == 1 else (b, heads, t, d)
    assert rows.shape == grouped and rows.data_ptr() == joined.data_ptr()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    kept = []

    def pack(t):
        kept.append(t.untyped_storage().data_ptr())
        return t

    with Ops() as ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_rmsnorm(q, (d,), w, eps=1e-6)
    assert "clone" not in ops.seen, ops.seen  # what a dense copy of the view would be
    assert joined.untyped_storage().data_ptr() not in kept
    ref, dx, (dw,) = _reference(lambda x_, w_: F.rms_norm(x_, (d,), w_, 1e-6), q, (w,), y)
    _close(y, ref, atol, rtol, "output")
    if grad:
        g = torch.randn_like(y)
        y.backward(g)
        ref, dx, (dw,) = _reference(lambda x_, w_: F.rms_norm(x_, (d,), w_, 1e-6), q, (w,), g)
        dq = joined.grad[..., : heads * d].reshape(b, t, heads, d)
        dq = dq.transpose(1, 2) if transposed else dq
        _close(dq, dx, atol * 2, rtol * 2, "input gradient")
        assert not joined.grad[..., heads * d :].any()
        _close(w.grad, dw, atol * 4, rtol * 4, "weight gradient")


@pytest.mark.parametrize("width", [7, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
def test_rmsnorm_of_narrow_rows_agrees_across_the_programs_that_share_them(width, per_head):
    # Narrow rows (a q/k norm's heads) are taken several to a program; the last program
    # gets a partial tile, whose missing rows are neither read nor written.
    from xpuruntime.pytorch._ops._infra._launch import forward_rows

    rows = 2 * forward_rows(max(16, 1 << (width - 1).bit_length()), 1)[0] + 3
    if per_head:  # rows of 3 heads read in place from a joined row of 5
        joined = _fresh((rows, 5 * width), torch.float32)
        x = joined[:, : 3 * width].view(rows, 3, width)
    else:
        x = joined = _fresh((rows, width), torch.float32)
    w = _fresh((width,), torch.float32)
    y = fused_rmsnorm(x, (width,), w, eps=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, (dw,) = _reference(lambda x_, w_: F.rms_norm(x_, (width,), w_, 1e-6), x, (w,), g)
    _close(y, ref, 1e-5, 1e-5, "output")
    dxs = joined.grad[:, : 3 * width].view(rows, 3, width) if per_head else joined.grad
    _close(dxs, dx, 2e-5, 2e-5, "input gradient")
    _close(w.grad, dw, 1e-4, 1e-4, "weight gradient")


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_rounds_the_fp32_result_once_and_keeps_the_input_gradient_dtype(op, out_dtype):
    n = 200
    x = _fresh((6, n), torch.float32, shift=2.0)
    w = _fresh((n,), torch.float32)
    b = _fresh((n,), torch.float32)
    if op == "layernorm":
        y = fused_layernorm(x, n, w, b, out_dtype=out_dtype)
        ref_fn = lambda x_, w_, b_: F.layer_norm(x_, (n,), w_, b_, 1e-5)  # noqa: E731
    else:
        y = fused_rmsnorm(x, n, w, 1e-6, out_dtype=out_dtype)
        ref_fn = lambda x_, w_, b_: F.rms_norm(x_, (n,), w_, 1e-6)  # noqa: E731
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, (dw, db) = _reference(ref_fn, x, (w, b), g)
    assert y.dtype == out_dtype and x.grad.dtype == torch.float32
    assert w.grad.dtype == torch.float32
    # One rounding of the fp32 result: within one unit in the last place of out_dtype.
    ulp = 2.0 ** -(7 if out_dtype == torch.bfloat16 else 10)
    _close(y, ref, 1e-5, ulp, "output")
    _close(x.grad, dx, 1e-4, 1e-4, "input gradient")
    _close(w.grad, dw, 1e-4, 1e-4, "weight gradient")
    if op == "layernorm":
        _close(b.grad, db, 1e-4, 1e-4, "bias gradient")


def test_out_dtype_must_be_a_float_dtype():
    with pytest.raises(xrt.InvalidInputError, match="out_dtype must be"):
        fused_layernorm(torch.ones(2, 8, device=DEVICE), 8, out_dtype=torch.int8)


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_autocast_norms_makes_either_kernel_return_the_autocast_dtype(kernel):
    norm, rms = FusedLayerNorm(64).to(DEVICE), FusedRMSNorm(64).to(DEVICE)
    x = _fresh((5, 64), torch.float32)
    policy = {"kernels": {"layernorm": kernel, "rmsnorm": kernel}, "strict": True}
    with xpt.kernel_policy(policy), torch.autocast(DEVICE, dtype=torch.bfloat16):
        plain = norm(x), rms(x)
    with xpt.kernel_policy({**policy, "autocast_norms": True}):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            emitted = norm(x), rms(x)
        outside = norm(x)  # no autocast: the input's dtype
    assert [t.dtype for t in emitted] == [torch.bfloat16, torch.bfloat16]
    assert outside.dtype == torch.float32
    for a, b in zip(emitted, plain, strict=True):  # the same result, rounded to bf16
        _close(a, b.double(), 1e-5, 2.0**-7, "the kernel's result in bf16")
    (emitted[0].float().sum() + emitted[1].float().sum()).backward()
    assert x.grad.dtype == torch.float32 and norm.weight.grad.dtype == torch.float32


def test_rmsnorm_default_eps_is_the_dtype_epsilon_as_in_nn_rmsnorm():
    x = _fresh((3, 64), torch.float32, grad=False) * 1e-4  # small enough for eps to matter
    ref = F.rms_norm(x.double(), (64,), None, torch.finfo(torch.float32).eps)
    _close(fused_rmsnorm(x, 64), ref, 1e-5, 1e-5, "output")


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: fused_layernorm(torch.ones(3, 8, device=DEVICE), (4,)), "does not end with"),
        (lambda: fused_layernorm(torch.ones(3, 8, dtype=torch.int32, device=DEVICE), 8), "dtype"),
        (
            lambda: fused_layernorm(
                torch.ones(3, 8, device=DEVICE), 8, torch.ones(4, device=DEVICE)
            ),
            "weight must have shape",
        ),
        (lambda: fused_layernorm(torch.ones(3, 8, device=DEVICE), (0,)), "size >= 1"),
        (lambda: fused_rmsnorm(torch.ones(3, 8, device=DEVICE), "8"), "int or a sequence"),
    ],
)
def test_bad_inputs_are_named(call, needle):
    with pytest.raises(xrt.InvalidInputError, match=needle):
        call()


def test_cpu_tensors_without_the_interpreter_fall_back_or_are_refused_when_strict():
    # 05_training_module: where our kernel cannot run, PyTorch's op runs, with a warning;
    # a strict policy makes it an error naming the reason.
    code = (
        "import warnings, torch, xpuruntime as xrt\n"
        "from xpuruntime import pytorch as xpt\n"
        "from xpuruntime.pytorch.ops import fused_layernorm\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    y = fused_layernorm(torch.ones(2, 8), 8)\n"
        "print('fell back:', [str(w.message) for w in caught])\n"
        "xpt.set_kernel_policy(strict=True)\n"
        "try:\n"
        "    fused_layernorm(torch.ones(2, 8), 8)\n"
        "except xrt.UnsupportedOperationError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert 'fell back: ["fused_layernorm: Triton kernels run on CUDA devices' in out.stdout
    assert "refused: fused_layernorm: Triton kernels run on CUDA devices" in out.stdout


def test_fused_modules_are_drop_ins_sharing_state_dicts():
    ln = nn.LayerNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    fused = FusedLayerNorm(48, eps=1e-6).to(DEVICE)
    fused.load_state_dict(ln.state_dict())
    assert fused.state_dict().keys() == ln.state_dict().keys()
    shared = FusedLayerNorm.from_layernorm(ln)
    assert shared.weight is ln.weight and shared.bias is ln.bias
    x = _fresh((5, 48), torch.float32, grad=False)
    with xpt.kernel_policy(layernorm="fused", strict=True):
        _close(fused(x), ln(x).double(), 1e-5, 1e-5, "FusedLayerNorm")
        _close(shared(x), ln(x).double(), 1e-5, 1e-5, "from_layernorm")

    rms = nn.RMSNorm(48, eps=1e-6).to(DEVICE)
    fused_rms = FusedRMSNorm(48, eps=1e-6).to(DEVICE)
    fused_rms.load_state_dict(rms.state_dict())
    with xpt.kernel_policy(rmsnorm="fused", strict=True):
        _close(fused_rms(x), rms(x).double(), 1e-5, 1e-5, "FusedRMSNorm")
        _close(FusedRMSNorm.from_module(rms)(x), rms(x).double(), 1e-5, 1e-5, "from_module")


@pytest.mark.parametrize(
    "kernel, evidence", [("fused", "xpuruntime::layer_norm"), ("torch", "native_layer_norm")]
)
def test_the_layernorm_policy_decides_what_the_module_runs_and_the_log_shows_it(kernel, evidence):
    norm = FusedLayerNorm(32).to(DEVICE)
    x = _fresh((4, 32), torch.float32)
    xpt.enable_dispatch_logging()
    with xpt.kernel_policy(layernorm=kernel, strict=True):
        norm(x).sum().backward()
    records = [r for r in xpt.get_dispatch_logs() if r.op == "layernorm" and "aten_op" in r.context]
    assert {r.context["phase"] for r in records} == {"forward", "backward"}
    assert all(r.chosen == kernel and r.source == "policy" for r in records), records
    assert any(evidence in r.context["aten_op"] for r in records)


def test_auto_under_best_performance_measures_both_and_records_the_timings():
    norm = FusedLayerNorm(64).to(DEVICE)
    x = _fresh((8, 64), torch.float32)
    with xpt.kernel_policy(auto_strategy="best_performance"):
        norm(x)
        text = xpt.explain_kernel_policy()
    assert "layernorm: 1 call shape(s) resolved" in text
    assert "fastest when measured" in text and "fused" in text and "torch" in text


def test_fused_ops_trace_through_torch_compile_with_autograd():
    model = nn.Sequential(nn.Linear(24, 40), FusedLayerNorm(40), nn.GELU(), FusedRMSNorm(40)).to(
        DEVICE
    )
    x = _fresh((6, 24), torch.float32, grad=False)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


class LlamaRMSNorm(nn.Module):
    """The shape of Hugging Face's LlamaRMSNorm (a copy of its math, not an import)."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(LlamaRMSNorm):
    def forward(self, x):
        return super().forward(x) / self.weight * (1 + self.weight)


def test_optimize_replaces_norms_sharing_parameters_reports_skips_and_reverts():
    model = nn.ModuleDict(
        {
            "ln": nn.LayerNorm(32),
            "rms": nn.RMSNorm(32, eps=1e-6),
            "llama": LlamaRMSNorm(32),
            "gemma": GemmaRMSNorm(32),
            "bn": nn.BatchNorm1d(32),
            "mha": nn.MultiheadAttention(32, 4, batch_first=True),
        }
    ).to(DEVICE)
    with torch.no_grad():
        model["ln"].weight.normal_()
    x = _fresh((3, 32), torch.float32, grad=False)
    before = {k: model[k](x) for k in ("ln", "rms", "llama", "gemma")}
    keys = model.state_dict().keys()

    report = xpt.optimize(
        model, {"kernels": {"layernorm": "fused", "rmsnorm": "fused"}, "strict": True}
    )
    assert {(p, new) for p, _, new in report.replaced} == {
        ("ln", "xpt.nn.LayerNorm"),
        ("rms", "xpt.nn.RMSNorm"),
        ("llama", "xpt.nn.RMSNorm"),
        ("gemma", "xpt.nn.RMSNorm"),  # scaling by 1 + weight
    }
    assert model["gemma"].weight_offset == 1.0 and model["llama"].weight_offset == 0.0
    reasons = dict(report.skipped)
    assert "BatchNorm1d" in reasons["bn"]
    assert "MultiheadAttention" in reasons["mha"]
    assert model["ln"].weight is not None and model.state_dict().keys() == keys
    assert xpt.get_kernel_policy().get("layernorm") == "fused"
    xpt.enable_dispatch_logging()
    for k, expected in before.items():
        _close(model[k](x), expected.double(), 2e-5, 2e-5, k)
    ran = {r.context["aten_op"] for r in xpt.get_dispatch_logs() if "aten_op" in r.context}
    assert {"xpuruntime::layer_norm", "xpuruntime::rms_norm"} <= ran
    assert "replaced 4 module(s)" in str(report)

    report.revert()
    assert type(model["ln"]) is nn.LayerNorm and type(model["llama"]) is LlamaRMSNorm
    assert xpt.get_kernel_policy() is None


def test_a_frozen_gemma_norms_scale_is_kept_and_follows_in_place_writes():
    """Gemma's RMSNorm scales by ``1 + weight``. A frozen weight's scale (LoRA's norms)
    is made once and kept, not made again in every call. An in-place write (an
    optimizer's, ``load_state_dict``'s) makes it anew, and a trained weight still gets
    transformers' gradient."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from xpuruntime.pytorch._ops._infra._frozen_casts import frozen_scale

    torch.manual_seed(0)
    reference = Gemma3RMSNorm(24, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        reference.weight.normal_()
    model = nn.Sequential(Gemma3RMSNorm(24, eps=1e-6)).to(DEVICE)
    model.load_state_dict({"0.weight": reference.weight.detach()})
    xpt.optimize(model)
    norm, x = model[0], torch.randn(3, 24, device=DEVICE)
    assert isinstance(norm, xpt.nn.RMSNorm) and norm.weight_offset == 1.0
    norm.weight.requires_grad_(False)
    with torch.inference_mode():  # (an evaluation first: what it keeps trains too)
        norm(x)
    kept = frozen_scale(norm.weight, 1.0)
    assert not kept.is_inference()
    assert frozen_scale(norm.weight, 1.0) is kept
    leaf = x.clone().requires_grad_()
    norm(leaf).sum().backward()  # (the kept scale saved for a backward)
    _close(norm(x), reference(x).double(), 1e-5, 1e-5, "frozen")
    assert frozen_scale(norm.weight, 1.0) is kept  # (the call took the kept one)
    with torch.no_grad():
        norm.weight.add_(0.25)
        reference.weight.add_(0.25)
    assert frozen_scale(norm.weight, 1.0) is not kept
    _close(norm(x), reference(x).double(), 1e-5, 1e-5, "after an in-place write")
    norm.weight.requires_grad_(True)
    norm(x).square().sum().backward()
    reference(x).square().sum().backward()
    _close(norm.weight.grad, reference.weight.grad.double(), 1e-4, 1e-4, "trained weight")


def test_optimize_refuses_what_is_not_a_module():
    with pytest.raises(xrt.InvalidInputError, match="nn.Module"):
        xpt.optimize("model")


def test_rows_of_65536_and_more_take_the_chunked_path_and_stay_exact():
    n = 65537  # past 65536, and odd, so the last chunk is a one-element tail
    x = _fresh((2, n), torch.float32, shift=2.0)
    w, b = _fresh((n,), torch.float32), _fresh((n,), torch.float32)
    g = torch.randn(2, n, device=DEVICE)
    y = fused_layernorm(x, n, w, b)
    y.backward(g)
    ref, dx, (dw, db) = _reference(lambda x_, w_, b_: F.layer_norm(x_, (n,), w_, b_), x, (w, b), g)
    _close(y, ref, 1e-5, 1e-5, "layernorm output")
    _close(x.grad, dx, 4e-5, 4e-5, "layernorm input gradient")
    _close(w.grad, dw, 4e-5, 4e-5, "layernorm weight gradient")
    _close(b.grad, db, 4e-5, 4e-5, "layernorm bias gradient")
    x.grad = w.grad = None
    y = fused_rmsnorm(x, n, w, 1e-6)
    y.backward(g)
    ref, dx, (dw,) = _reference(lambda x_, w_: F.rms_norm(x_, (n,), w_, 1e-6), x, (w,), g)
    _close(y, ref, 1e-5, 1e-5, "rmsnorm output")
    _close(x.grad, dx, 4e-5, 4e-5, "rmsnorm input gradient")
    _close(w.grad, dw, 4e-5, 4e-5, "rmsnorm weight gradient")


@pytest.mark.parametrize("shape", [(1, 5), (3, 7), (70, 33), (528, 768)])
def test_the_partial_sums_second_stage_equals_a_float64_sum_and_repeats_exactly(shape):
    from xpuruntime.pytorch._ops._infra._partials import sum_rows

    partial = torch.randn(shape, device=DEVICE, dtype=torch.float32)
    total = sum_rows(partial)
    assert total.shape == (shape[1],) and total.dtype == torch.float32
    torch.testing.assert_close(total.double(), partial.double().sum(0), atol=1e-4, rtol=1e-5)
    assert torch.equal(sum_rows(partial), total)  # a fixed order: deterministic


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "residual"])
def test_a_fused_norm_adds_one_node_to_the_autograd_graph_whatever_the_inputs_rank(norm):
    # Flattening to rows happens inside the op, so no view nodes surround it (each
    # would be one more node for the autograd engine to run per call).
    from xpuruntime.pytorch.ops import fused_add_layernorm

    x, r = _fresh((2, 3, 16), torch.float32), _fresh((2, 3, 16), torch.float32)
    w, b = _fresh((16,), torch.float32), _fresh((16,), torch.float32)
    if norm == "layernorm":
        out, leaves = fused_layernorm(x, (16,), w, b), 3
    elif norm == "rmsnorm":
        out, leaves = fused_rmsnorm(x, (16,), w), 2
    else:
        out, leaves = fused_add_layernorm(x, r, 16, w, b)[1], 4
    assert out.shape == x.shape
    following = [type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None]
    assert following == ["AccumulateGrad"] * leaves
    out.backward(torch.ones_like(out))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape

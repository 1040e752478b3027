"""The cuBLASLt GELU epilogues (through nvmath-python): linear_gelu's cublaslt kernel (one
GEMM whose GELU_AUX_BIAS epilogue writes GELU's input and output, with fused_linear_gelu's
backward) and the mlp op's (fused_mlp: GELU's derivative in the DGELU epilogue of the
second layer's input-gradient GEMM).

Without a GPU or without nvmath-python these tests check the refusals; with both, the
numbers against PyTorch's pair and float64, in eager, captured and compiled runs."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops._infra import _cublaslt  # noqa: E402
from xpuruntime.pytorch._ops.fused_mlp import unsupported  # noqa: E402
from xpuruntime.pytorch.ops import fused_linear_gelu, fused_mlp  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")

CUDA = torch.device("cuda")


def _nvmath_present() -> bool:
    try:
        import nvmath.bindings.cublasLt  # noqa: F401
    except ImportError:
        return False
    return True


needs_epilogue = pytest.mark.skipif(
    not torch.cuda.is_available() or _cublaslt.unavailable() is not None,
    reason="needs a CUDA GPU and nvmath-python",
)


# -- refusals (any machine) --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "dtype", "features", "approximate", "says"),
    [
        (torch.device("cpu"), torch.bfloat16, (64, 256), "tanh", "runs on CUDA devices"),
        (CUDA, torch.float32, (64, 256), "tanh", "bf16 or fp16"),
        (CUDA, torch.bfloat16, (64, 256), "none", "tanh approximation"),
        (CUDA, torch.float16, (60, 256), "tanh", "multiples of 8"),
        (CUDA, torch.bfloat16, (64, 250), "tanh", "got 64 and 250"),
    ],
)
def test_the_epilogue_refuses_each_layer_it_cannot_run_and_says_why(
    device, dtype, features, approximate, says
):
    assert says in _cublaslt.refusal(device, dtype, *features, approximate)
    assert _cublaslt.refusal(CUDA, torch.float16, 64, 256, "tanh") is None


@pytest.mark.skipif(_nvmath_present(), reason="nvmath-python is installed")
def test_the_cublaslt_forward_without_nvmath_names_the_package_to_install():
    # On a device our Triton kernels take (CUDA, or the CPU under TRITON_INTERPRET=1),
    # so that the missing library is what is refused.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, b = (torch.randn(*shape, device=device) for shape in ((4, 16), (32, 16), (32,)))
    with pytest.raises(xrt.BackendUnavailableError, match=r"nvmath-python.*xpuruntime\[cublaslt\]"):
        with torch.autocast(device, dtype=torch.bfloat16):
            fused_linear_gelu(x, w, b, "tanh", forward="cublaslt")


def test_fused_linear_gelu_refuses_an_unknown_forward_by_name():
    x, w, b = torch.randn(4, 16), torch.randn(32, 16), torch.randn(32)
    with pytest.raises(xrt.InvalidInputError, match="forward must be 'torch' or 'cublaslt'"):
        fused_linear_gelu(x, w, b, "tanh", forward="cutlass")


class _MLP(nn.Module):
    def __init__(self, d, gelu):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(d, 4 * d), gelu, nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x).float().square().mean()
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("op", ["linear_gelu", "mlp"])
def test_a_strict_policy_naming_cublaslt_raises_with_the_reason_where_it_cannot_run(op):
    # An exact (erf) GELU: refused everywhere (by the device, the package or the form).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(_MLP(16, nn.GELU())).to(device)
    report = xpt.optimize(model, {"kernels": {op: "cublasLt"}, "strict": True})
    assert (report.fused_mlps if op == "mlp" else report.fused_gelus) == ["0.c_fc"]
    errors = (xrt.BackendUnavailableError, xrt.UnsupportedOperationError)
    with pytest.raises(errors, match="cuBLASLt"):
        model(torch.randn(2, 3, 16, device=device))
    report.revert()


def test_a_lenient_policy_falls_back_to_the_fused_kernel_and_warns_once():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(16, nn.GELU()), _MLP(16, nn.GELU())).to(device)
    x = torch.randn(2, 3, 16, device=device)
    want = _loss_and_grads(model, x)
    report = xpt.optimize(model, {"kernels": {"linear_gelu": "cublaslt"}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _loss_and_grads(model, x)
    fallbacks = [w for w in caught if issubclass(w.category, xrt.FallbackWarning)]
    assert len(fallbacks) == 1 and "cuBLASLt" in str(fallbacks[0].message)  # once, not per layer
    assert "fused (fallback)" in xpt.explain_kernel_policy()
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    report.revert()


# -- the epilogue itself (GPU with nvmath-python) ------------------------------------------------
def _leaves(lead, k, n, dtype=torch.float32):
    x = torch.randn(*lead, k, device="cuda", dtype=dtype).requires_grad_()
    w = (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).requires_grad_()
    b = (0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
    return x, w, b


def _float64_pair(x, w, b, grad):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    out = F.gelu(F.linear(*leaves), approximate="tanh")
    out.backward(grad.double())
    return out, *(t.grad for t in leaves)


@pytest.mark.gpu
@needs_epilogue
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 50, 96, 136), (4096, 768, 3072)])
def test_the_epilogue_forward_is_pytorchs_pair_within_a_rounding_and_as_exact(shape, dtype):
    torch.manual_seed(1)
    *lead, k, n = shape
    x, w, b = _leaves(lead, k, n)
    with torch.autocast("cuda", dtype=dtype):
        ours = fused_linear_gelu(x, w, b, "tanh", forward="cublaslt")
        theirs = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape
    grad = torch.randn_like(ours)
    want = _float64_pair(x, w, b, grad.float())
    ours_grads = torch.autograd.grad(ours, (x, w, b), grad)
    theirs_grads = torch.autograd.grad(theirs, (x, w, b), grad)
    for mine, pytorchs, expected in zip((ours, *ours_grads), (theirs, *theirs_grads), want):
        mine_err = (mine.double() - expected).abs().max()
        pytorchs_err = (pytorchs.double() - expected).abs().max()
        # The same roundings in another order: no further off than PyTorch's pair.
        assert mine_err <= 1.5 * pytorchs_err + 1e-3 * expected.abs().max()


@pytest.mark.gpu
@needs_epilogue
def test_the_epilogue_reads_operands_that_start_off_their_allocation():
    torch.manual_seed(2)
    base = torch.randn(2 * 64 * 256 + 8, device="cuda", dtype=torch.bfloat16)
    x = base[8:].view(128, 256)  # 16 bytes past the allocation's start
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) / 16
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    out, pre = _cublaslt.gelu_aux_linear(x, w, b)
    want_pre = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(pre.double(), want_pre, atol=0.05, rtol=0.02)
    want = F.gelu(want_pre, approximate="tanh")
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.02)


def _two_mlps(seed):
    torch.manual_seed(seed)
    return nn.Sequential(_MLP(64, nn.GELU("tanh")), _MLP(64, nn.GELU("tanh"))).cuda()


@pytest.mark.gpu
@needs_epilogue
def test_the_policy_runs_cublaslt_forward_and_logs_it_with_pytorchs_gradients():
    model = _two_mlps(3)
    x = torch.randn(4, 32, 64, device="cuda")

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _loss_and_grads(model, x)

    want = run()
    report = xpt.optimize(model, {"kernels": {"linear_gelu": "cublasLt"}, "strict": True})
    xpt.enable_dispatch_logging()
    got = run()
    records = [r for r in xpt.get_dispatch_logs() if r.op == "linear_gelu"]
    xpt.disable_dispatch_logging()
    ran = {r.context.get("aten_op") for r in records}
    forward = [r for r in records if r.context.get("aten_op") == "xpuruntime::gelu_aux_linear"]
    assert len(forward) == 2 and all(r.chosen == "cublasLt" for r in forward)
    assert "xpuruntime::gelu_backward" in ran
    assert all(r.source == "policy" for r in records)
    torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=1e-2)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=5e-2)
    report.revert()


def _mse(out, target):
    return F.mse_loss(out.float(), target)


@pytest.mark.gpu
@needs_epilogue
def test_the_epilogue_traces_through_torch_compile_as_our_op():
    torch.manual_seed(4)
    x, w, b = _leaves((8, 16), 64, 128)

    def mlp(x, w, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fused_linear_gelu(x, w, b, "tanh", forward="cublaslt").float().square().sum()

    compiled = torch.compile(mlp, fullgraph=True)
    out = compiled(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b))
    eager = mlp(x, w, b)
    expected = torch.autograd.grad(eager, (x, w, b))
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


# -- the mlp op: GELU's derivative in the second layer's input-gradient GEMM ------------------
def test_fused_mlp_refuses_mismatched_layers_by_name():
    x, w1, b1 = torch.randn(4, 16), torch.randn(32, 16), torch.randn(32)
    w2, b2 = torch.randn(16, 32), torch.randn(16)
    with pytest.raises(xrt.InvalidInputError, match=r"proj_weight \(16, 24\) must be"):
        fused_mlp(x, w1, b1, torch.randn(16, 24), b2)
    with pytest.raises(xrt.InvalidInputError, match=r"second layer.*bias must have shape \(16,\)"):
        fused_mlp(x, w1, b1, w2, torch.randn(17))


def test_the_mlp_refuses_a_second_layer_whose_rows_are_not_16_bytes():
    assert "out_features to be a multiple of 8" in unsupported(
        CUDA, torch.bfloat16, 64, 256, 60, "tanh"
    )
    assert unsupported(CUDA, torch.bfloat16, 64, 256, 64, "tanh") is None
    assert "tanh approximation" in unsupported(CUDA, torch.bfloat16, 64, 256, 64, "none")


class _Net(nn.Module):
    """Two MLPs, one whose GELU output is used again (left to linear_gelu)."""

    def __init__(self, d, gelu):
        super().__init__()
        self.mlp = _MLP(d, gelu)
        self.fc, self.gelu, self.out = nn.Linear(d, 2 * d), gelu, nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.mlp(x)
        h = self.gelu(self.fc(x))
        return self.out(h) + h[..., : x.shape[-1]]


def test_optimize_rewrites_whole_mlps_first_and_leaves_linear_gelu_the_rest():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(6)
    model = _Net(16, nn.GELU("tanh")).to(device)
    x = torch.randn(2, 3, 16, device=device)
    want = _loss_and_grads(model, x)
    # In fp32 the epilogues refuse, so auto runs the layers as written (linear_gelu
    # routing the first with its GELU).
    report = xpt.optimize(model, {"kernels": {"mlp": "auto", "linear_gelu": "fused"}})
    assert report.fused_mlps == ["mlp.c_fc"] and report.fused_gelus == ["fc"]
    assert "1 GELU(s), 1 MLP(s)" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (without a GPU and nvmath: auto takes torch)
        got = _loss_and_grads(model, x)
    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=1e-2)
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.gpu
@needs_epilogue
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 8, 16, 8), (3, 50, 96, 136, 64), (4096, 768, 3072, 768)])
def test_fused_mlp_is_pytorchs_mlp_within_its_roundings(shape, with_bias):
    torch.manual_seed(7)
    *lead, k, n, c = shape
    x, w1, b1 = _leaves(lead, k, n)
    w2 = (torch.randn(c, n, device="cuda") / n**0.5).requires_grad_()
    b2 = (0.1 * torch.randn(c, device="cuda")).requires_grad_()
    if not with_bias:
        b1 = b2 = None
    leaves = [t for t in (x, w1, b1, w2, b2) if t is not None]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = fused_mlp(x, w1, b1, w2, b2)
        theirs = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    grad = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, leaves, grad)
    theirs_grads = torch.autograd.grad(theirs, leaves, grad)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    e_w1b1 = exact[1:3] if with_bias else exact[1:2]
    e_w2b2 = exact[3:] if with_bias else exact[2:]
    expected = F.linear(F.gelu(F.linear(exact[0], *e_w1b1), approximate="tanh"), *e_w2b2)
    expected_grads = torch.autograd.grad(expected, exact, grad.double())
    assert ours.dtype == theirs.dtype == torch.bfloat16
    for mine, pytorchs, want in zip((ours, *ours_grads), (theirs, *theirs_grads),
                                    (expected, *expected_grads)):  # fmt: skip
        assert mine.dtype == pytorchs.dtype
        mine_err = (mine.double() - want).abs().max()
        pytorchs_err = (pytorchs.double() - want).abs().max()
        # (plus one bf16 rounding of the largest value: a few elements can each land a
        # rounding either side)
        assert mine_err <= 1.5 * pytorchs_err + 2**-8 * want.abs().max()


_FORWARD_OPS = {"linear_gelu": "xpuruntime::gelu_aux_linear", "mlp": "xpuruntime::gelu_mlp"}


@pytest.mark.gpu
@needs_epilogue
@pytest.mark.parametrize("op", ["linear_gelu", "mlp"])
def test_a_captured_step_under_a_cublaslt_op_replays_its_logged_eager_steps(op):
    data = [(torch.randn(4, 32, 64, device="cuda"), torch.randn(4, 32, 64, device="cuda"))]
    data += [(torch.randn_like(x), torch.randn_like(y)) for x, y in data * 3]
    policy = {"precision": "bf16", "strict": True, "kernels": {op: "cublasLt"}}
    results = []
    for graph in (False, True):
        model = _two_mlps(8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        step, report = xpt.make_train_step(
            model, _mse, opt, data[0], dict(policy, cuda_graph=graph)
        )
        fused = report.fused_mlps if op == "mlp" else report.fused_gelus
        assert fused == ["0.c_fc", "1.c_fc"]
        if not graph:
            xpt.enable_dispatch_logging()
        results.append([step(batch).item() for batch in data])
        if not graph:
            records = [r for r in xpt.get_dispatch_logs() if r.op == op]
            xpt.disable_dispatch_logging()
            forward = [r for r in records if r.context.get("aten_op") == _FORWARD_OPS[op]]
            assert len(forward) == 2 * len(data)
            assert all(r.chosen == "cublasLt" for r in forward)
            assert all(r.source == "policy" for r in records)
        report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, rel=1e-4), (graphed, eager)


@pytest.mark.gpu
@needs_epilogue
def test_fused_mlp_traces_through_torch_compile_as_our_ops():
    x, w1, b1 = _leaves((8, 16), 64, 128)
    w2 = torch.randn(64, 128, device="cuda", requires_grad=True)

    def f(x, w1, b1, w2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fused_mlp(x, w1, b1, w2, None).float().square().sum()

    out = torch.compile(f, fullgraph=True)(x, w1, b1, w2)
    grads = torch.autograd.grad(out, (x, w1, b1, w2))
    eager = f(x, w1, b1, w2)
    expected = torch.autograd.grad(eager, (x, w1, b1, w2))
    for got, want in zip((out, *grads), (eager, *expected)):
        torch.testing.assert_close(got, want)

"""fused_linear_gelu (a linear layer and the GELU after it, whose backward computes GELU's
gradient and the bias gradient in one pass) against float64 and against PyTorch's pair,
on the CPU under TRITON_INTERPRET=1 (compiled on a GPU); and the policy's linear_gelu op,
which optimize() wires into a model's forward."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops.fused_linear import gelu_backward  # noqa: E402
from xpuruntime.pytorch.ops import fused_linear_gelu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


def _leaves(lead, k, n, with_bias, dtype=torch.float32):
    x = torch.randn(*lead, k, device=DEVICE, dtype=dtype).requires_grad_()
    w = (torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5).requires_grad_()
    b = torch.randn(n, device=DEVICE, dtype=dtype).requires_grad_() if with_bias else None
    return x, w, b


def _float64(x, w, b, grad, approximate):
    """The pair's output and gradients (x, w, b) in float64."""
    leaves = [
        t.detach().double().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())
    ]
    out = F.gelu(F.linear(*leaves), approximate=approximate)
    out.backward(grad.double())
    return out, *(t.grad for t in leaves)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 13, 40, 129), (300, 64, 70)])
def test_fused_linear_gelu_matches_float64_forward_and_backward(shape, with_bias, approximate):
    torch.manual_seed(0)
    *lead, k, n = shape
    x, w, b = _leaves(lead, k, n, with_bias)
    out = fused_linear_gelu(x, w, b, approximate=approximate)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = _float64(x, w, b, grad, approximate)
    assert out.shape == (*lead, n) and out.dtype == torch.float32
    for got, expected in zip((out, x.grad, w.grad) + ((b.grad,) if with_bias else ()), want):
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_equals_pytorchs_from_saturation_to_zero_with_the_columns_summed(
    approximate,
):
    pre = torch.linspace(-30, 30, 257 * 40, device=DEVICE).view(257, 40)
    pre[0, :6] = torch.tensor([0.0, -0.0, 1e-7, -1e-7, 1e-30, 88.0])
    dh = torch.randn_like(pre)
    dpre, db = gelu_backward(dh, pre, approximate, torch.float32)
    want = torch.ops.aten.gelu_backward(dh.double(), pre.double(), approximate=approximate)
    torch.testing.assert_close(dpre.double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(db.double(), want.sum(0), atol=1e-4, rtol=1e-5)
    assert gelu_backward(dh, pre, approximate, None)[1] is None


def test_under_autocast_the_output_is_pytorchs_and_the_gradients_at_least_as_exact():
    torch.manual_seed(1)
    dtype = torch.bfloat16
    x, w, b = _leaves((6, 50), 96, 80, True)
    with torch.autocast(DEVICE, dtype=dtype):
        ours = fused_linear_gelu(x, w, b, approximate="tanh")
        theirs = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)  # the same two kernels
    grad = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (x, w, b), grad)
    theirs_grads = torch.autograd.grad(theirs, (x, w, b), grad)
    _, *want = _float64(x, w, b, grad.float(), "tanh")
    for mine, pytorchs, expected in zip(ours_grads, theirs_grads, want):
        assert mine.dtype == torch.float32
        mine_err = (mine.double() - expected).abs().max()
        pytorchs_err = (pytorchs.double() - expected).abs().max()
        assert mine_err <= 1.5 * pytorchs_err + 1e-6


def test_fused_linear_gelu_refuses_an_unknown_approximation_and_bad_shapes_by_name():
    x, w, b = _leaves((4,), 8, 6, True)
    with pytest.raises(xrt.InvalidInputError, match="fused_linear_gelu: approximate must be"):
        fused_linear_gelu(x, w, b, approximate="erf")
    with pytest.raises(xrt.InvalidInputError, match="fused_linear_gelu: input"):
        fused_linear_gelu(x, w.t(), b)


def test_fused_linear_gelu_traces_through_torch_compile_with_autograd():
    torch.manual_seed(2)
    x, w, b = _leaves((4, 5), 24, 40, True)

    def mlp(x, w, b):
        return fused_linear_gelu(x, w, b, approximate="tanh").square().sum()

    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    out = compiled(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b))
    eager = mlp(x, w, b)
    expected = torch.autograd.grad(eager, (x, w, b))
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


# -- the policy's linear_gelu op, through optimize() -------------------------------------------
class _MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = (
            nn.Linear(d, 4 * d),
            nn.GELU("tanh"),
            nn.Linear(4 * d, d),
        )

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = _MLP(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + F.gelu(self.fc(x))  # an F.gelu call, exact form
        return x + self.mlp(self.ln_2(x))


def _model_with_reference(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(_Block(16), _Block(16)).to(DEVICE)
    x = torch.randn(2, 5, 16, device=DEVICE)
    return model, x, _loss_and_grads(model, x)


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()]


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_optimize_fuses_each_linear_feeding_a_gelu_alone_with_the_same_gradients():
    model, x, want = _model_with_reference(3)
    report = xpt.optimize(model, {"kernels": {"linear_gelu": "fused"}})
    # The blocks, holding no GELU module, are not traced for this op alone: their
    # F.gelu calls run as written.
    assert report.fused_gelus == ["0.mlp.c_fc", "1.mlp.c_fc"]
    assert "2 GELU(s)" in str(report)
    xpt.enable_dispatch_logging()
    got = _loss_and_grads(model, x)
    ops = [r.context.get("aten_op") for r in xpt.get_dispatch_logs()]
    assert ops.count("xpuruntime::gelu_backward") == 2
    records = [r for r in xpt.get_dispatch_logs() if r.op == "linear_gelu"]
    assert records and all(r.chosen == "fused" and r.source == "policy" for r in records)
    _assert_same(got, want)
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_both_rewrites_apply_to_one_forward_with_the_same_gradients():
    model, x, want = _model_with_reference(4)
    report = xpt.optimize(
        model, {"kernels": {"linear_gelu": "fused", "residual_layernorm": "fused"}}
    )
    # Traced for their norms, the blocks' F.gelu calls are fused too.
    assert report.fused_gelus == ["0.fc", "0.mlp.c_fc", "1.fc", "1.mlp.c_fc"]
    assert report.fused_residuals == ["0.ln_2", "1.ln_2"]
    _assert_same(_loss_and_grads(model, x), want)
    report.revert()


class _Reused(_MLP):
    def forward(self, x):
        h = self.c_fc(x)
        return self.c_proj(self.gelu(h) + h)  # the linear output has a second user


class _LeakyGELU(nn.GELU):
    def forward(self, x):
        return super().forward(x) + 0.01 * x


class _Subclassed(_MLP):
    def __init__(self, d):
        super().__init__(d)
        self.gelu = _LeakyGELU()


@pytest.mark.parametrize("mlp", [_Reused, _Subclassed])
def test_a_linear_output_used_again_or_a_gelu_subclass_is_left_as_written(mlp):
    torch.manual_seed(5)
    model = nn.Sequential(mlp(8), mlp(8)).to(DEVICE)
    x = torch.randn(3, 8, device=DEVICE)
    want = model(x)
    report = xpt.optimize(model, {"kernels": {"linear_gelu": "fused"}})
    assert report.fused_gelus == []
    torch.testing.assert_close(model(x), want)
    report.revert()

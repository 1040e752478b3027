"""fused_linear and FusedLinear against a float64 reference and against nn.Linear under
autocast, on the CPU under TRITON_INTERPRET=1 (and compiled on a GPU), plus the policy's
linear op and optimize()."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops.fused_linear import column_sums  # noqa: E402
from xpuruntime.pytorch.ops import FusedLinear, fused_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(shape, device=DEVICE, dtype=dtype).requires_grad_()


def _reference(x, w, b, grad):
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    b64 = None if b is None else b.detach().double().requires_grad_()
    out = F.linear(x64, w64, b64)
    out.backward(grad.double())
    return out, x64.grad, w64.grad, None if b64 is None else b64.grad


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 13, 40, 129), (257, 64, 3)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_linear_matches_float64_forward_and_backward(shape, with_bias):
    *lead, k, n = shape
    x, w = _leaf(*lead, k), _leaf(n, k)
    b = _leaf(n) if with_bias else None
    y = fused_linear(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    ref, dx, dw, db = _reference(x, w, b, g)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), dx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), dw, atol=1e-4, rtol=1e-5)
    if with_bias:
        torch.testing.assert_close(b.grad.double(), db, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_parameter_gradients_come_back_in_fp32_at_least_as_exact(dtype):
    if DEVICE == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast runs linear in bf16 only")
    x, w, b = _leaf(6, 50, 96), _leaf(80, 96), _leaf(80)
    with torch.autocast(DEVICE, dtype=dtype):
        ours = fused_linear(x, w, b)
        theirs = F.linear(x, w, b)
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)  # the same forward GEMM
    g = torch.randn_like(ours)
    ours.backward(g)
    mine = [t.grad for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    theirs.backward(g)
    _, _, dw, db = _reference(x, w, b, g.float())
    assert [t.dtype for t in mine] == [torch.float32] * 3
    torch.testing.assert_close(mine[0], x.grad, atol=0, rtol=0)  # dx: the same GEMM
    # dW and db are accumulated in fp32 and rounded once (not to bf16/fp16 first).
    for name, got, pytorch, exact in (
        ("weight", mine[1], w.grad, dw),
        ("bias", mine[2], b.grad, db),
    ):
        err, pytorch_err = (
            (got.double() - exact).abs().max(),
            (pytorch.double() - exact).abs().max(),
        )
        assert err <= pytorch_err * 1.01 + 1e-6, (name, float(err), float(pytorch_err))


@pytest.mark.parametrize("m, n", [(1, 1), (1, 300), (31, 129), (4099, 7), (2048, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_sums_cover_every_column_and_row(m, n, dtype):
    g = torch.randn(m, n, device=DEVICE, dtype=dtype) + 0.5  # non-zero sums
    expected = g.double().sum(0)
    got = column_sums(g)
    assert got.dtype == torch.float32 and got.shape == (n,)
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=1e-5)
    assert torch.equal(column_sums(g), got)  # deterministic
    torch.testing.assert_close(
        column_sums(g.t().contiguous().t()).double(), expected, atol=1e-3, rtol=1e-5
    )


def test_frozen_parameters_get_no_gradient_and_the_input_still_does():
    x, w = _leaf(4, 16), torch.randn(8, 16, device=DEVICE)
    b = torch.randn(8, device=DEVICE, requires_grad=True)
    fused_linear(x, w, b).sum().backward()
    assert w.grad is None and x.grad is not None and b.grad is not None
    torch.testing.assert_close(b.grad, torch.full_like(b, 4.0))


@pytest.mark.parametrize(
    "args, needle",
    [
        (lambda: (torch.ones(2, 5), torch.ones(3, 4), None), "must end with in_features"),
        (lambda: (torch.ones(2, 4), torch.ones(3, 4), torch.ones(4)), "bias must have shape"),
        (lambda: (torch.ones(2, 4, dtype=torch.int64), torch.ones(3, 4), None), "input must be"),
        (lambda: (torch.ones(2, 4), torch.ones(3, 4, dtype=torch.bfloat16), None), "must match"),
    ],
)
def test_bad_inputs_are_named(args, needle):
    x, w, b = (None if t is None else t.to(DEVICE) for t in args())
    with pytest.raises(xrt.InvalidInputError, match=needle):
        fused_linear(x, w, b)


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_the_linear_policy_decides_what_the_module_runs_and_the_log_shows_it(kernel):
    layer = FusedLinear(24, 10).to(DEVICE)
    x = _leaf(5, 24)
    xpt.enable_dispatch_logging()
    with xpt.kernel_policy(linear=kernel, strict=True):
        layer(x).sum().backward()
    ran = [r for r in xpt.get_dispatch_logs() if r.op == "linear" and "aten_op" in r.context]
    if kernel == "fused":
        assert [r.context["aten_op"] for r in ran] == ["xpuruntime::linear_parameter_grads"]
        assert ran[0].chosen == "fused" and ran[0].source == "policy"
        assert ran[0].context["phase"] == "backward"
    else:
        assert ran == []  # PyTorch's linear shows as matmul records only
    decided = [
        r for r in xpt.get_dispatch_logs() if r.op == "linear" and "aten_op" not in r.context
    ]
    assert decided and decided[0].chosen == kernel


def test_fused_linear_module_is_a_drop_in_sharing_parameters():
    linear = nn.Linear(12, 7).to(DEVICE)
    shared = FusedLinear.from_linear(linear)
    assert shared.weight is linear.weight and shared.bias is linear.bias
    fresh = FusedLinear(12, 7).to(DEVICE)
    fresh.load_state_dict(linear.state_dict())
    x = torch.randn(3, 12, device=DEVICE)
    with xpt.kernel_policy(linear="fused", strict=True):
        torch.testing.assert_close(shared(x), linear(x))
        torch.testing.assert_close(fresh(x), linear(x))


def test_optimize_replaces_linears_only_when_the_policy_names_linear():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.fc = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 50, bias=False)

        def forward(self, idx):
            return self.lm_head(torch.relu(self.fc(self.emb(idx))))

    model = Tiny().to(DEVICE)
    report = xpt.optimize(model, {"kernels": {"layernorm": "fused"}})
    assert type(model.fc) is nn.Linear
    report.revert()
    original_fc = model.fc
    report = xpt.optimize(model, {"kernels": {"linear": "fused"}})
    assert type(model.fc) is FusedLinear and model.fc.weight is original_fc.weight
    assert type(model.lm_head).__name__ == "LinearCrossEntropyHead"  # the loss op's
    idx = torch.randint(0, 50, (2, 9), device=DEVICE)
    loss = F.cross_entropy(model(idx).view(-1, 50), idx.view(-1))
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.bias.grad is not None
    report.revert()
    assert model.fc is original_fc and type(model.lm_head) is nn.Linear


def test_fused_linear_traces_through_torch_compile_with_autograd():
    model = nn.Sequential(FusedLinear(24, 40), nn.GELU(), FusedLinear(40, 8)).to(DEVICE)
    x = torch.randn(6, 24, device=DEVICE)
    with xpt.kernel_policy(linear="fused", strict=True):
        eager = model(x)
        eager.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(x)
        out.sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.gpu
def test_a_layer_whose_backward_pytorch_computes_alike_takes_pytorchs_node():
    # Nothing cast and a small output: PyTorch's own linear backward computes our
    # gradients (the GEMMs in the parameters' dtype, the bias gradient by Tensor.sum),
    # so no autograd.Function of ours is recorded; under autocast with fp32 parameters
    # ours is, for its fp32 parameter gradients.
    x, w, b = (_leaf(*s, dtype=torch.bfloat16) for s in ((4, 32, 256), (512, 256), (512,)))
    y = fused_linear(x, w, b)
    assert "Function" not in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    y.backward(g)
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).backward(g)
    assert all(torch.equal(a, t.grad) for a, t in zip(got, (x, w, b)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fused_linear(x.float().detach().requires_grad_(), w.float().detach().requires_grad_())
    assert "Function" in type(y.grad_fn).__name__

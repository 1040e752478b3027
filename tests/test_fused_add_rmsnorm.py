"""fused_add_rmsnorm (a residual add and the RMS norm of its sum) against PyTorch's add
and a float64 RMS norm, forward and backward, on the CPU under TRITON_INTERPRET=1
(compiled on a GPU); and the policy's residual_rmsnorm op, which optimize() binds into
transformers' decoder layers (tested on their tiny configs in test_hf_models.py)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch.ops import fused_add_rmsnorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (6e-2, 2e-2),
}

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


def _fresh(shape, dtype, scale=1.0):
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE) * scale
    return t.to(dtype).requires_grad_()


def _reference(x, y, w, gh, gn, h, eps=1e-6):
    """float64 gradients of (x + y, rms_norm(x + y)) under the same output gradients,
    the norm reading the sum ``h`` as stored (rounded to its dtype)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, y, w)]
    x64, y64, w64 = leaves
    exact = x64 + y64
    h64 = exact + (h.detach().double() - exact).detach()
    n64 = F.rms_norm(h64, w64.shape, w64, eps)
    torch.autograd.backward([h64, n64], [gh.double(), gn.double()])
    return [t.grad for t in leaves]


@pytest.mark.parametrize(
    "x_dtype, y_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # an fp32 residual plus a bf16 branch (autocast)
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 127), (4, 768), (2, 20011)])
def test_fused_add_rmsnorm_equals_the_add_then_the_norm_forward_and_backward(
    x_dtype, y_dtype, shape
):
    torch.manual_seed(0)
    x, y = _fresh(shape, x_dtype, 3.0), _fresh(shape, y_dtype)
    w = _fresh(shape[-1:], torch.float32)
    h, n = fused_add_rmsnorm(x, y, shape[-1:], w, 1e-6)
    h_dtype = torch.promote_types(x_dtype, y_dtype)
    assert h.dtype == n.dtype == h_dtype
    if DEVICE == "cpu" and h_dtype == torch.bfloat16:
        # Triton's CPU interpreter truncates fp32 to bf16 (the GPU rounds to nearest even).
        torch.testing.assert_close(h, x + y, atol=0, rtol=2**-7)
    else:
        assert torch.equal(h, x + y)
    atol, rtol = TOLERANCES[h_dtype]
    expected = F.rms_norm(h.detach().double(), shape[-1:], w.double(), 1e-6)
    torch.testing.assert_close(n.double(), expected, atol=atol, rtol=rtol)

    gh, gn = torch.randn_like(h), torch.randn_like(n)
    torch.autograd.backward([h, n], [gh, gn])
    for name, leaf, want in zip("xyw", (x, y, w), _reference(x, y, w, gh, gn, h)):
        assert leaf.grad.dtype == leaf.dtype, name
        atol, rtol = TOLERANCES[leaf.dtype]
        scale = want.abs().max().item()
        torch.testing.assert_close(
            leaf.grad.double(), want, atol=atol * max(1.0, scale), rtol=rtol, msg=name
        )


@pytest.mark.parametrize("used", ["sum", "norm"])
def test_an_output_nothing_uses_contributes_no_gradient(used):
    torch.manual_seed(1)
    x, y = _fresh((6, 96), torch.float32), _fresh((6, 96), torch.float32)
    w = _fresh((96,), torch.float32)
    h, n = fused_add_rmsnorm(x, y, 96, w, 1e-6)
    out = h if used == "sum" else n
    g = torch.randn_like(out)
    out.backward(g)
    zero = torch.zeros_like(g)
    want = _reference(x, y, w, g if used == "sum" else zero, zero if used == "sum" else g, h)
    for leaf, expected in zip((x, y, w), want):
        torch.testing.assert_close(leaf.grad.double(), expected, atol=1e-5, rtol=1e-5)


def test_without_a_weight_and_eps_it_is_the_sums_dtype_epsilon_as_nn_rmsnorm():
    x, y = _fresh((4, 64), torch.float32), _fresh((4, 64), torch.float32)
    h, n = fused_add_rmsnorm(x, y, 64)
    want = torch.nn.RMSNorm(64, elementwise_affine=False).to(DEVICE)(h.detach())
    torch.testing.assert_close(n, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda x: (x, x[:, :32], 64), "normalized_shape"),
        (lambda x: (x, x[:2], 64), "same shape"),
        (lambda x: (x, x.long(), 64), "dtype"),
        (lambda x: (x, x, 64, torch.ones(32, device=DEVICE)), "weight must have shape"),
    ],
)
def test_fused_add_rmsnorm_refuses_bad_input_by_name(make, words):
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(xrt.InvalidInputError, match=words):
        fused_add_rmsnorm(*make(x))


def test_fused_add_rmsnorm_traces_through_torch_compile_with_autograd():
    torch.manual_seed(2)
    x, y = _fresh((4, 96), torch.float32), _fresh((4, 96), torch.bfloat16)
    w = _fresh((96,), torch.float32)

    def pair(x, y, w):
        h, n = fused_add_rmsnorm(x, y, 96, w, 1e-6)
        return (h * 2).sum() + (n * n).sum()

    compiled = torch.compile(pair, backend="aot_eager", fullgraph=True)
    out = compiled(x, y, w)
    grads = torch.autograd.grad(out, (x, y, w))
    eager = pair(x, y, w)
    expected = torch.autograd.grad(eager, (x, y, w))
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_the_residual_rmsnorm_op_equals_the_add_then_the_module(offset, kernel):
    """Through our RMSNorm module, with Gemma's 1 + weight too."""
    from xpuruntime.pytorch._functional._residual import residual_norm

    torch.manual_seed(3)
    plain = torch.nn.RMSNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        plain.weight.normal_()
    norm = xpt.nn.RMSNorm.from_module(plain, weight_offset=offset)
    xpt.set_kernel_policy(residual_rmsnorm=kernel, rmsnorm="fused")
    x, y = _fresh((3, 5, 48), torch.float32), _fresh((3, 5, 48), torch.float32)
    h, n = residual_norm(x, y, norm)
    from xpuruntime.pytorch._selection._routed import ROUTED_OPS

    assert [d.chosen for d in ROUTED_OPS["residual_rmsnorm"].decisions.values()] == [kernel]
    (h.sum() + (n * n).sum()).backward()
    got = [t.grad.clone() for t in (x, y, norm.weight)]
    for t in (x, y, norm.weight):
        t.grad = None
    with xpt.kernel_policy(residual_rmsnorm="torch", rmsnorm="torch"):
        h2 = x + y
        n2 = norm(h2)
        (h2.sum() + (n2 * n2).sum()).backward()
    torch.testing.assert_close(h, h2)
    torch.testing.assert_close(n, n2, atol=1e-5, rtol=1e-5)
    for a, t in zip(got, (x, y, norm.weight)):
        torch.testing.assert_close(a, t.grad, atol=1e-4, rtol=1e-4)


# -- optimize() binds it into a decoder layer by what its forward's source computes ----------
_LAYER_SOURCE = """
from torch import nn


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.post_norm = nn.RMSNorm(16, eps=1e-6)

    def forward(self, hidden):
        residual = hidden
        hidden = self.proj(hidden)
        hidden = hidden + residual  # the add in the other order
        # a comment between the statements changes nothing
        residual = hidden
        hidden = self.post_norm(hidden)
        return residual + self.proj(hidden)
"""


def _layer_module(tmp_path, monkeypatch, name):
    import importlib

    (tmp_path / f"{name}.py").write_text(_LAYER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_optimize_binds_the_residual_op_into_a_layer_we_did_not_write_and_reverts(
    tmp_path, monkeypatch
):
    module = _layer_module(tmp_path, monkeypatch, "xrt_test_layer_a")
    torch.manual_seed(4)
    model = torch.nn.Sequential(module.Layer(), module.Layer()).to(DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    want = model(x)
    original = module.Layer.forward
    report = xpt.optimize(model, {"kernels": {"residual_rmsnorm": "fused", "rmsnorm": "fused"}})
    assert report.fused_residuals == ["0.post_norm", "1.post_norm"]
    assert "forward" in model[0].__dict__ and module.Layer.forward is original  # class untouched
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    from xpuruntime.pytorch._selection._routed import ROUTED_OPS

    assert [d.chosen for d in ROUTED_OPS["residual_rmsnorm"].decisions.values()] == ["fused"]
    report.revert()
    assert "forward" not in model[0].__dict__
    assert torch.equal(model(x), want)


def test_a_forward_whose_file_changed_since_it_was_imported_is_left_as_it_runs(
    tmp_path, monkeypatch
):
    module = _layer_module(tmp_path, monkeypatch, "xrt_test_layer_b")
    path = tmp_path / "xrt_test_layer_b.py"
    path.write_text(
        _LAYER_SOURCE.replace("hidden = self.proj(hidden)\n", "hidden = self.proj(hidden) * 2\n", 1)
    )
    model = torch.nn.Sequential(module.Layer()).to(DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    want = model(x)
    report = xpt.optimize(model, {"kernels": {"residual_rmsnorm": "fused"}})
    assert report.fused_residuals == []  # the source read is not the code that runs
    torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "residual-norm"])
def test_a_frozen_weight_gets_no_gradient_and_none_is_summed(residual):
    """A frozen norm weight (a LoRA base's) gets no gradient, and the backward sums none
    (no fp32 partial rows are made); the input gradients are a trainable weight's."""
    from tensors_made import tensors_made

    from xpuruntime.pytorch.ops import fused_rmsnorm

    grads = {}
    for trains in (True, False):
        torch.manual_seed(0)
        x = torch.randn(64, 96, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn_like(x, requires_grad=True)
        w = (torch.rand(96, device=DEVICE, dtype=torch.bfloat16) + 0.5).requires_grad_(trains)
        g = torch.randn(64, 96, device=DEVICE, dtype=torch.bfloat16)
        if residual:
            h, n = fused_add_rmsnorm(x, y, 96, w, 1e-6)
            loss = (n * g).sum() + (h * g.flip(0)).sum()
        else:
            loss = (fused_rmsnorm(x, 96, w, 1e-6) * g).sum()
        with tensors_made() as made:
            loss.backward()
        partials = [t for t in made if t.dtype == torch.float32 and t.shape[-1:] == (96,)]
        assert bool(partials) == trains and (w.grad is not None) == trains
        grads[trains] = (x.grad, y.grad) if residual else (x.grad,)
    for frozen, trained in zip(grads[False], grads[True]):
        assert torch.equal(frozen, trained)

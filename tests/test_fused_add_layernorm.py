"""fused_add_layernorm (a residual add and the layer norm of its sum) against PyTorch's
add and a float64 layer norm, forward and backward, on the CPU under TRITON_INTERPRET=1
(compiled on a GPU); and the policy's residual_layernorm op, which optimize() wires into
a model's forward."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch.ops import fused_add_layernorm  # noqa: E402

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


def _reference(x, y, w, b, gh, gn, h):
    """float64 gradients of (x + y, layer_norm(x + y)) under the same output gradients,
    the norm reading the sum ``h`` as stored (rounded to its dtype, as the unfused pair
    reads it; ``h`` is checked against PyTorch's add separately)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, y, w, b)]
    x64, y64, w64, b64 = leaves
    exact = x64 + y64
    h64 = exact + (h.detach().double() - exact).detach()
    n64 = F.layer_norm(h64, w64.shape, w64, b64, 1e-5)
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
def test_fused_add_layernorm_equals_the_add_then_the_norm_forward_and_backward(
    x_dtype, y_dtype, shape
):
    torch.manual_seed(0)
    x, y = _fresh(shape, x_dtype, 3.0), _fresh(shape, y_dtype)
    w, b = _fresh(shape[-1:], torch.float32), _fresh(shape[-1:], torch.float32)
    h, n = fused_add_layernorm(x, y, shape[-1:], w, b)
    h_dtype = torch.promote_types(x_dtype, y_dtype)
    # The sum is PyTorch's own (fp32 math, one rounding); the norm reads it as stored.
    assert h.dtype == n.dtype == h_dtype
    if DEVICE == "cpu" and h_dtype == torch.bfloat16:
        # Triton's CPU interpreter truncates fp32 to bf16 (the GPU rounds to nearest even).
        torch.testing.assert_close(h, x + y, atol=0, rtol=2**-7)
    else:
        assert torch.equal(h, x + y)
    atol, rtol = TOLERANCES[h_dtype]
    expected = F.layer_norm(h.detach().double(), shape[-1:], w.double(), b.double(), 1e-5)
    torch.testing.assert_close(n.double(), expected, atol=atol, rtol=rtol)

    gh, gn = torch.randn_like(h), torch.randn_like(n)
    torch.autograd.backward([h, n], [gh, gn])
    for name, leaf, want in zip("xywb", (x, y, w, b), _reference(x, y, w, b, gh, gn, h)):
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
    w, b = _fresh((96,), torch.float32), _fresh((96,), torch.float32)
    h, n = fused_add_layernorm(x, y, 96, w, b)
    out = h if used == "sum" else n
    g = torch.randn_like(out)
    out.backward(g)
    zero = torch.zeros_like(g)
    want = _reference(x, y, w, b, g if used == "sum" else zero, zero if used == "sum" else g, h)
    for leaf, expected in zip((x, y, w, b), want):
        torch.testing.assert_close(leaf.grad.double(), expected, atol=1e-5, rtol=1e-5)


def test_fused_add_layernorm_emits_the_norm_in_out_dtype():
    x, y = _fresh((4, 64), torch.float32), _fresh((4, 64), torch.bfloat16)
    w, b = _fresh((64,), torch.float32), _fresh((64,), torch.float32)
    h, n = fused_add_layernorm(x, y, 64, w, b, out_dtype=torch.bfloat16)
    assert h.dtype == torch.float32 and n.dtype == torch.bfloat16
    expected = F.layer_norm(h.detach(), (64,), w.detach(), b.detach(), 1e-5)
    torch.testing.assert_close(n.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "args, words",
    [
        (((4, 64), (64,)), "same shape"),
        (((4, 64), (4, 32)), "normalized_shape"),
    ],
)
def test_fused_add_layernorm_refuses_bad_shapes_by_name(args, words):
    x = torch.randn(*args[0], device=DEVICE)
    y = torch.randn(*args[1], device=DEVICE)
    with pytest.raises(xrt.InvalidInputError, match=words):
        fused_add_layernorm(x, y, 64)


def test_fused_add_layernorm_refuses_integer_inputs_misshapen_weights_and_dtypes():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(xrt.InvalidInputError, match="dtype"):
        fused_add_layernorm(x, torch.ones(4, 64, dtype=torch.int64, device=DEVICE), 64)
    with pytest.raises(xrt.InvalidInputError, match="weight must have shape"):
        fused_add_layernorm(x, x, 64, torch.ones(32, device=DEVICE))
    with pytest.raises(xrt.InvalidInputError, match="out_dtype"):
        fused_add_layernorm(x, x, 64, out_dtype=torch.int32)


def test_fused_add_layernorm_traces_through_torch_compile_with_autograd():
    torch.manual_seed(2)
    x, y = _fresh((4, 96), torch.float32), _fresh((4, 96), torch.bfloat16)
    w, b = _fresh((96,), torch.float32), _fresh((96,), torch.float32)

    def pair(x, y, w, b):
        h, n = fused_add_layernorm(x, y, 96, w, b)
        return (h * 2).sum() + (n * n).sum()

    compiled = torch.compile(pair, backend="aot_eager", fullgraph=True)
    out = compiled(x, y, w, b)
    grads = torch.autograd.grad(out, (x, y, w, b))
    eager = pair(x, y, w, b)
    expected = torch.autograd.grad(eager, (x, y, w, b))
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


# -- the policy's residual_layernorm op, through optimize() ------------------------------------
class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = nn.Linear(d, d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                             nn.Linear(2 * d, d))  # fmt: skip

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Model(nn.Module):
    def __init__(self, d=32, layers=2, vocab=50):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.out(self.ln_f(x))


POLICY = {"kernels": {"residual_layernorm": "fused", "layernorm": "fused"}}


def _loss_and_grads(model, idx):
    model.zero_grad()
    loss = model(idx).square().mean()
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()]


def _optimized_with_reference(seed):
    """(model, idx, its loss and gradients before optimize, the report of optimize)."""
    torch.manual_seed(seed)
    model = _Model().to(DEVICE)
    idx = torch.randint(0, 50, (2, 8), device=DEVICE)
    want = _loss_and_grads(model, idx)
    return model, idx, want, xpt.optimize(model, POLICY)


def _assert_same_loss_and_grads(loss, grads, want):
    want_loss, want_grads = want
    torch.testing.assert_close(loss, want_loss)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_optimize_fuses_each_reused_residual_add_into_the_next_norm_with_the_same_gradients():
    model, idx, want, report = _optimized_with_reference(3)
    # Block 0's ln_1 follows the embeddings' broadcasting add (runs unfused); ln_f follows
    # an add nothing else uses (nothing to gain).
    assert report.fused_residuals == ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2"]
    xpt.enable_dispatch_logging()
    loss, grads = _loss_and_grads(model, idx)
    ops = [r.context.get("aten_op") for r in xpt.get_dispatch_logs()]
    assert ops.count("xpuruntime::add_layer_norm") == 3
    assert ops.count("xpuruntime::add_layer_norm_backward") == 3
    _assert_same_loss_and_grads(loss, grads, want)
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_without_residual_layernorm_in_the_policy_no_forward_is_rewritten():
    model = _Model()
    report = xpt.optimize(model, {"kernels": {"layernorm": "fused"}})
    assert report.fused_residuals == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    report.revert()


class _Branches(_Block):
    def forward(self, x):
        if x.shape[0] > 1:  # control flow on a traced value: fx cannot follow it
            x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Optional(_Block):
    def forward(self, x, mask=None):
        return super().forward(x)


class _TrainingOnly(_Block):
    def forward(self, x):
        if self.training:  # a concrete bool: fx would freeze one branch
            x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@pytest.mark.parametrize(
    "block, words",
    [(_Branches, "torch.fx"), (_Optional, "'mask'"), (_TrainingOnly, "self.training")],
)
def test_a_forward_that_cannot_be_rewritten_is_reported_with_the_reason(block, words):
    model = nn.Sequential(block(16), block(16))
    report = xpt.optimize(model, POLICY)
    assert report.fused_residuals == []
    reasons = dict(report.skipped)
    assert set(reasons) == {"0", "1"} and all(words in why for why in reasons.values())
    x = torch.randn(2, 3, 16, device=DEVICE)
    torch.testing.assert_close(model.to(DEVICE)(x), model(x))
    report.revert()


def test_a_rewritten_model_compiles_into_one_graph():
    model, idx, want, report = _optimized_with_reference(4)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(idx).square().mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    _assert_same_loss_and_grads(loss, grads, want)
    report.revert()


def test_a_compiled_model_is_not_rewritten_and_says_why():
    model = _Model()
    report = xpt.optimize(torch.compile(model, backend="aot_eager"), POLICY)
    assert report.fused_residuals == []
    assert "torch.compile'd" in dict(report.skipped)["<model>"]
    assert all("forward" not in m.__dict__ for m in model.modules())
    report.revert()


class _ScaledNorm(nn.LayerNorm):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_layernorm_subclass_with_its_own_forward_keeps_its_add():
    model = _Model()
    for block in model.h:
        block.ln_2 = _ScaledNorm(32)
    report = xpt.optimize(model, {"kernels": {"residual_layernorm": "fused"}})
    assert report.fused_residuals == ["h.0.ln_1", "h.1.ln_1"]
    assert all("overrides the forward of LayerNorm" in dict(report.skipped)[f"h.{i}.ln_2"]
               for i in (0, 1))  # fmt: skip
    assert all(type(block.ln_2) is _ScaledNorm for block in model.h)
    report.revert()


def test_auto_under_best_performance_measures_both_without_touching_the_model():
    model = _Model().to(DEVICE)
    idx = torch.randint(0, 50, (2, 8), device=DEVICE)
    report = xpt.optimize(model, {"auto_strategy": "best_performance",
                                  "kernels": {"residual_layernorm": "auto"}})  # fmt: skip
    model(idx)  # forward only: the measurements' backward passes are their own
    assert all(p.grad is None for p in model.parameters())
    text = xpt.explain_kernel_policy()
    assert "residual_layernorm" in text and "fastest when measured" in text
    report.revert()


@pytest.mark.parametrize(
    "residual,width", [(False, 96), (True, 96), (False, 16385)], ids=["norm", "residual-norm", "wide"]
)  # fmt: skip
def test_a_frozen_weight_or_bias_gets_no_gradient_and_none_is_summed(residual, width):
    """A frozen layer-norm weight or bias (a LoRA base's) gets no gradient and the backward
    sums none of it (no fp32 partial rows where both are frozen); the input gradients and
    a trained parameter's gradient are what they are with both trained. Wide rows take
    the looped kernels."""
    from tensors_made import tensors_made

    from xpuruntime.pytorch.ops import fused_layernorm

    rows = 4 if width > 1024 else 64
    grads = {}
    for trains in ((True, True), (False, False), (True, False), (False, True)):
        torch.manual_seed(0)
        x = torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn_like(x, requires_grad=True)
        w = (torch.rand(width, device=DEVICE, dtype=torch.bfloat16) + 0.5).requires_grad_(trains[0])
        b = torch.randn(width, device=DEVICE, dtype=torch.bfloat16).requires_grad_(trains[1])
        g = torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16)
        if residual:
            h, n = fused_add_layernorm(x, y, width, w, b, 1e-5)
            loss = (n * g).sum() + (h * g.flip(0)).sum()
        else:
            loss = (fused_layernorm(x, width, w, b, 1e-5) * g).sum()
        with tensors_made() as made:
            loss.backward()
        partials = [t for t in made if t.dtype == torch.float32 and t.shape[-1:] == (width,)]
        assert bool(partials) == any(trains)
        assert (w.grad is not None, b.grad is not None) == trains
        grads[trains] = (x.grad, y.grad if residual else None, w.grad, b.grad)
    both = grads[(True, True)]
    for trains, got in grads.items():
        assert torch.equal(got[0], both[0])
        assert got[1] is None or torch.equal(got[1], both[1])
        for trained, grad, want in zip(trains, got[2:], both[2:]):
            assert not trained or torch.equal(grad, want)

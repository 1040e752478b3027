"""The per-head RMSNorm and rotary embedding in one op (``_ops.norm_rope``): against
float64, forward and backward, on what Qwen3's and Gemma3's attention hand it (a
(B, H, T, D) view of the joined q/k/v projection), in both pair layouts, with Gemma's
offset weight, a frozen weight, and angles per batch or shared."""

import pytest
import torch

from xpuruntime.pytorch._ops.norm_rope import run_norm_rope, torch_norm_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton runs on the CPU only under TRITON_INTERPRET=1",
)


def _angles(batch, length, width, shared):
    position = torch.arange(length, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    angle = torch.cat([position * freq] * 2, dim=-1)[None].expand(1 if shared else batch, -1, -1)
    angle = angle + (0 if shared else torch.arange(batch, dtype=torch.float64)[:, None, None])
    return angle.cos().to(DEVICE), angle.sin().to(DEVICE)


def _reference(x, w, cos, sin, eps, offset, interleaved):
    x64, w64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w))
    y = torch_norm_rope(x64, w64, cos, sin, eps, offset, interleaved)
    return x64, w64, y


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("trained", [True, False])
def test_norm_then_rope_of_a_per_head_view_agrees_with_float64(
    interleaved, offset, shared, trained
):
    torch.manual_seed(0)
    batch, length, heads, others, width = 2, 11, 3, 2, 16
    joined = torch.randn(batch, length, (heads + others) * width, dtype=torch.float64)
    joined = joined.float().to(DEVICE).requires_grad_()
    x = joined[..., : heads * width].view(batch, length, heads, width).transpose(1, 2)
    w = (torch.randn(width, dtype=torch.float64) * 0.5).float().to(DEVICE).requires_grad_(trained)
    cos, sin = _angles(batch, length, width, shared)
    y = run_norm_rope(x, w, cos.float(), sin.float(), 1e-6, offset, interleaved)
    assert y.shape == x.shape and y.transpose(1, 2).is_contiguous()
    x64, w64, ref = _reference(x, w, cos, sin, 1e-6, offset, interleaved)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g.double())
    dx = joined.grad[..., : heads * width].view(batch, length, heads, width).transpose(1, 2)
    torch.testing.assert_close(dx.double(), x64.grad, atol=2e-5, rtol=2e-5)
    assert not joined.grad[..., heads * width :].any()
    if trained:
        torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)
    else:
        assert w.grad is None


def test_norm_then_rope_without_gradients_keeps_nothing_and_gives_the_same_output():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 7, 8, device=DEVICE)
    w = torch.randn(8, device=DEVICE)
    cos, sin = _angles(1, 7, 8, True)
    with torch.no_grad():
        y = run_norm_rope(x, w, cos.float(), sin.float(), 1e-6)
    ref = torch_norm_rope(x.double(), w.double(), cos, sin, 1e-6)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    assert y.grad_fn is None


def test_norm_then_rope_in_half_precision_rounds_once():
    torch.manual_seed(2)
    x = torch.randn(2, 4, 9, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    w = torch.randn(32, dtype=torch.float16, device=DEVICE)
    cos, sin = _angles(2, 9, 32, True)
    y = run_norm_rope(x, w, cos.float(), sin.float(), 1e-6)
    assert y.dtype == torch.float16
    ref = torch_norm_rope(x.double(), w.double(), cos, sin, 1e-6)
    torch.testing.assert_close(y.double(), ref, atol=2e-3, rtol=2e-3)


# -- optimize's rewrite of an attention's forward ---------------------------------------------
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class _HeadNormed(torch.nn.Module):
    """Qwen3's attention in small: q and k from per-head norms, then the rope."""

    def __init__(self, norm_shape=8):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.k_proj = torch.nn.Linear(16, 8, bias=False)
        self.q_norm = torch.nn.RMSNorm(norm_shape, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(8, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.normal_()
            self.k_norm.weight.normal_()

    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, 8)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return (q.sum(1, keepdim=True) * k).sum(-1)


class _ReadBetween(_HeadNormed):
    """The same with q read between its norm and the rope: left as written."""

    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], -1, 8)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        k = k + q.mean(1, keepdim=True)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return (q.sum(1, keepdim=True) * k).sum(-1)


def _optimized_pair(cls, **kwargs):
    import copy

    import xpuruntime.pytorch as xpt

    torch.manual_seed(3)
    model = torch.nn.Sequential(cls(**kwargs)).to(DEVICE)
    reference = copy.deepcopy(model)
    report = xpt.optimize(model)
    return model, reference, report


def _outputs_and_grads(model, x, cos, sin):
    out = model[0](x, cos, sin)
    out.pow(2).sum().backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    ("cls", "kwargs", "joined"),
    [
        (_HeadNormed, {}, True),
        (_HeadNormed, {"norm_shape": (2, 8)}, False),
        (_ReadBetween, {}, False),
    ],
)
def test_optimize_joins_head_norms_with_the_rope_only_where_it_computes_the_same(
    cls, kwargs, joined
):
    # The norms run with the rope where q and k come straight from per-head norms over
    # the head width; a norm over two dims, or q read between, runs as written.
    model, reference, report = _optimized_pair(cls, **kwargs)
    assert bool(report.fused_head_norms) == joined, report.fused_head_norms
    x = torch.randn(2, 5, 16, device=DEVICE)
    cos, sin = (t.float() for t in _angles(2, 5, 8, True))
    out, grads = _outputs_and_grads(model, x, cos, sin)
    ref, ref_grads = _outputs_and_grads(reference, x, cos, sin)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_a_policy_naming_torch_for_the_joined_op_keeps_the_norms_and_the_rope_apart():
    import xpuruntime.pytorch as xpt

    with xpt.kernel_policy(rmsnorm_rope="torch"):
        _, _, report = _optimized_pair(_HeadNormed)
    assert not report.fused_head_norms
    assert report.fused_ropes  # (the rope alone still runs as the rope op)


def test_norm_then_rope_traces_into_torch_compile_as_our_registered_op():
    torch.manual_seed(4)
    dense = torch.randn(2, 7, 3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    cos, sin = (t.float() for t in _angles(2, 7, 16, False))

    def call(dense, w):
        return run_norm_rope(dense.transpose(1, 2), w, cos, sin, 1e-6, 1.0)

    eager = call(dense, w)
    eager.pow(2).sum().backward()
    grads = [dense.grad.clone(), w.grad.clone()]
    dense.grad = w.grad = None
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    out = compiled(dense, w)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close([dense.grad, w.grad], grads)

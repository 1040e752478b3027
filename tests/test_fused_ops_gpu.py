"""Our Triton ops compiled on a GPU: torch.compile (inductor) and CUDA-graph capture of
modules using each op, and bf16 attention at a realistic size (run by scripts/gpu-check;
the CPU-interpreted correctness tests in test_fused_norms.py and test_flash_attention.py
run here compiled too)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops.flash_attention import flash_attention  # noqa: E402
from xpuruntime.pytorch.ops import FusedLayerNorm, FusedLinear, FusedRMSNorm  # noqa: E402

pytestmark = pytest.mark.gpu


class Block(nn.Module):
    """Pre-norm attention + MLP, every norm, linear layer and the attention ours."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = FusedLayerNorm(dim), FusedRMSNorm(dim, eps=1e-6)
        self.qkv, self.proj = FusedLinear(dim, 3 * dim), FusedLinear(dim, dim)
        self.mlp = nn.Sequential(FusedLinear(dim, 4 * dim), nn.GELU(), FusedLinear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = flash_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(att)
        return x + self.mlp(self.norm2(x))


def _model():
    torch.manual_seed(0)
    return Block().cuda().bfloat16()


@pytest.fixture(autouse=True)
def _fused_policy():
    with xpt.kernel_policy(layernorm="fused", rmsnorm="fused", linear="fused", strict=True):
        yield


def test_torch_compile_with_inductor_matches_eager_forward_and_backward():
    model = _model()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    eager.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, eager, atol=3e-2, rtol=3e-2)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, atol=3e-2, rtol=3e-2)


def test_cuda_graph_capture_and_replay_give_eager_results():
    model = _model()
    static_x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        for _ in range(2):
            model(static_x).float().square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
        static_out.float().square().mean().backward()
    for _ in range(2):
        fresh = torch.randn_like(static_x)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager_model = _model()
        expected = eager_model(fresh)
        expected.float().square().mean().backward()
        torch.testing.assert_close(static_out, expected, atol=3e-2, rtol=3e-2)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_attention_at_size_matches_pytorch_flash_within_bf16(causal, head_dim):
    q, k, v = (
        torch.randn(2, 8, 1000, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    ours = flash_attention(q, k, v, is_causal=causal)
    ours.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(grad.double())
    torch.testing.assert_close(ours.double(), ref, atol=2e-2, rtol=2e-2)
    for a, b in zip((t.grad for t in (q, k, v)), (t.grad for t in leaves)):
        torch.testing.assert_close(a.double(), b, atol=5e-2, rtol=5e-2)

"""The rope op: rotary position embedding of q and k in one Triton pass each way, equal
to PyTorch's expression of it in both layouts, on the layouts attention leaves q and k
in (Triton interpreter on the CPU, CUDA where there is one)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops.rope import rope, torch_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("our kernels run on the CPU under TRITON_INTERPRET=1", allow_module_level=True)


def _inputs(dtype, *, batch_cos: bool, transposed: bool, width: int = 8):
    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, tokens = 2, 4, 2, 5

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    if transposed:  # as attention leaves them: projections viewed and transposed
        q = rand(batch, tokens, heads, width).transpose(1, 2)
        k = rand(batch, tokens, kv_heads, width).transpose(1, 2)
    else:
        q, k = rand(batch, heads, tokens, width), rand(batch, kv_heads, tokens, width)
    angles = torch.randn(batch if batch_cos else 1, tokens, width // 2, generator=generator)
    angles = torch.cat([angles, angles], -1).to(DEVICE)
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("batch_cos", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_pytorchs_expression_forward_and_backward(
    dtype, batch_cos, transposed, interleaved
):
    q, k, cos, sin = _inputs(dtype, batch_cos=batch_cos, transposed=transposed)
    q.requires_grad_()
    k.requires_grad_()
    out_q, out_k = rope(q, k, cos, sin, interleaved)
    assert out_q.stride() == q.stride() and out_k.stride() == k.stride()  # the layout kept
    assert out_q.dtype == dtype
    # The reference in float64: ours computes in fp32 and rounds once.
    ref_q, ref_k = torch_rope(q.double(), k.double(), cos.double(), sin.double(), interleaved)
    tolerance = (
        {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    )
    torch.testing.assert_close(out_q.double(), ref_q, **tolerance)
    torch.testing.assert_close(out_k.double(), ref_k, **tolerance)
    dq_out, dk_out = torch.randn_like(out_q), torch.randn_like(out_k)
    grads = torch.autograd.grad((out_q * dq_out).sum() + (out_k * dk_out).sum(), (q, k))
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want_q, want_k = torch_rope(qd, kd, cos.double(), sin.double(), interleaved)
    want = torch.autograd.grad(
        (want_q * dq_out.double()).sum() + (want_k * dk_out.double()).sum(), (qd, kd)
    )
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.double(), expected, **tolerance)


def test_angles_of_another_dtype_give_pytorchs_result_within_one_rounding():
    """Under autocast the projections are bf16 while transformers' angles stay fp32:
    PyTorch then computes in fp32, and so does the kernel, from the fp32 angles (the
    interpreter rounds to bf16 by truncation, the GPU to nearest: one bf16 step apart)."""
    q, k, cos, sin = _inputs(torch.bfloat16, batch_cos=True, transposed=True)
    out_q, _ = rope(q, k, cos, sin)
    want_q, _ = torch_rope(q, k, cos, sin)  # bf16 * fp32: fp32 math
    assert want_q.dtype == torch.float32
    torch.testing.assert_close(out_q.float(), want_q, atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda q, k, c, s: (q[..., :7], k[..., :7], c[..., :7], s[..., :7]), "even head_dim"),
        (lambda q, k, c, s: (q, k, c[..., :4], s[..., :4]), "cos must be"),
        (lambda q, k, c, s: (q, k, c.requires_grad_(), s), "requires a gradient"),
        (lambda q, k, c, s: (q[0], k[0], c, s), "(batch, heads, tokens, head_dim)"),
        (lambda q, k, c, s: (q, k.double(), c, s), "share a dtype"),
    ],
)
def test_rope_refuses_what_it_cannot_compute_naming_it(change, needle):
    q, k, cos, sin = _inputs(torch.float32, batch_cos=True, transposed=False)
    with pytest.raises(xrt.InvalidInputError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rope(*change(q, k, cos.clone(), sin.clone()))


def test_the_policy_routes_rope_and_says_which_kernel_ran(clean_kernel_policy):
    from xpuruntime.pytorch._functional._rope import _rope
    from xpuruntime.pytorch._functional._rope import rope as routed

    q, k, cos, sin = _inputs(torch.float32, batch_cos=True, transposed=True)
    for kernel in ("fused", "torch"):
        xpt.set_kernel_policy(rope=kernel, strict=True)
        out = routed(q, k, cos, sin)
        torch.testing.assert_close(out[0], torch_rope(q, k, cos, sin)[0], atol=1e-6, rtol=1e-6)
        (decision,) = _rope.decisions.values()
        assert decision.chosen == kernel

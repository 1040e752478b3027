"""ops.swiglu and the policy's swiglu op: forward and backward against float64 PyTorch,
over shapes with primes and tails, in every float dtype; bad input named."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(torch.float32, 2e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]


_GATES = {
    "swiglu": torch.nn.functional.silu,
    "geglu": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}


@pytest.mark.parametrize("op", sorted(_GATES))
@pytest.mark.parametrize("shape", [(1,), (7, 13), (2, 3, 1031), (5, 2048)])
@pytest.mark.parametrize(("dtype", "tolerance"), CASES)
def test_gated_activations_match_float64_forward_and_backward(op, shape, dtype, tolerance):
    generator = torch.Generator().manual_seed(len(shape))
    gate64 = (3 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(DEVICE)
    up64 = torch.randn(shape, generator=generator, dtype=torch.float64).to(DEVICE)
    dh64 = torch.randn(shape, generator=generator, dtype=torch.float64).to(DEVICE)
    gate = gate64.to(dtype).requires_grad_()
    up = up64.to(dtype).requires_grad_()
    h = getattr(xpt.ops, op)(gate, up)
    h.backward(dh64.to(dtype))
    g, u = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    want = _GATES[op](g) * u
    want.backward(dh64.to(dtype).double())
    assert h.dtype == dtype and h.shape == want.shape
    for got, ref in ((h, want), (gate.grad, g.grad), (up.grad, u.grad)):
        scale = 1 + ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("op", sorted(_GATES))
@pytest.mark.parametrize("shape", [(1, 2), (7, 26), (2, 3, 2062)])
@pytest.mark.parametrize(("dtype", "tolerance"), CASES)
def test_packed_gate_and_up_match_float64_forward_and_backward(op, shape, dtype, tolerance):
    """up=None: the gate and up are the halves of one tensor, read and written in place."""
    generator = torch.Generator().manual_seed(len(shape))
    packed64 = (2 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(DEVICE)
    dh64 = torch.randn((*shape[:-1], shape[-1] // 2), generator=generator, dtype=torch.float64)
    packed = packed64.to(dtype).requires_grad_()
    h = getattr(xpt.ops, op)(packed)
    h.backward(dh64.to(DEVICE, dtype))
    p = packed.detach().double().requires_grad_()
    g, u = p.chunk(2, dim=-1)
    want = _GATES[op](g) * u
    want.backward(dh64.to(DEVICE, dtype).double())
    assert h.dtype == dtype and h.shape == want.shape
    for got, ref in ((h, want), (packed.grad, p.grad)):
        scale = 1 + ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("op", sorted(_GATES))
def test_the_routed_op_runs_the_policys_kernel_and_the_same_numbers(op):
    from xpuruntime.pytorch._functional import _activations

    gate = torch.randn(4, 96, device=DEVICE)
    up = torch.randn(4, 96, device=DEVICE)
    results = {}
    for kernel in ("torch", "fused"):
        xpt.set_kernel_policy({"kernels": {op: kernel}, "strict": True})
        xpt.enable_dispatch_logging()
        results[kernel] = getattr(_activations, op)(gate, up)
        xpt.disable_dispatch_logging()
        chosen = {r.chosen for r in xpt.get_dispatch_logs() if r.op == op}
        xpt.clear_dispatch_logs()
        assert chosen == {kernel}
    torch.testing.assert_close(results["fused"], results["torch"], atol=1e-6, rtol=1e-6)


def test_bad_input_is_named():
    a = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(xrt.InvalidInputError, match="gate and up must match"):
        xpt.ops.swiglu(a, torch.randn(3, 5, device=DEVICE))
    with pytest.raises(xrt.InvalidInputError, match="fp32, fp16 or bf16"):
        xpt.ops.swiglu(a.long(), a.long())
    with pytest.raises(xrt.InvalidInputError, match="must be a tensor"):
        xpt.ops.swiglu(a, [1.0])
    with pytest.raises(xrt.InvalidInputError, match="even last dimension"):
        xpt.ops.swiglu(torch.randn(3, 5, device=DEVICE))


def test_swiglu_traces_into_torch_compile_as_our_registered_op():
    gate = torch.randn(6, 40, device=DEVICE, requires_grad=True)
    up = torch.randn(6, 40, device=DEVICE, requires_grad=True)
    eager = xpt.ops.swiglu(gate, up)
    eager.sum().backward()
    grads = [gate.grad.clone(), up.grad.clone()]
    gate.grad = up.grad = None
    compiled = torch.compile(xpt.ops.swiglu, backend="aot_eager", fullgraph=True)
    out = compiled(gate, up)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close([gate.grad, up.grad], grads)

"""The lora_linear op's kernel (ops/lora_linear.py): one node for a LoRA layer or a group
of them on one input, forward and backward against a float64 reference (gradcheck), and
under bf16 autocast against float64 on shapes of primes, with the base frozen or not."""

import pytest

torch = pytest.importorskip("torch")

from xpuruntime.pytorch.ops.lora_linear import (  # noqa: E402
    lora_projections,
    torch_lora_projections,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layers(outs, ranks, width, dtype, bias, train_base, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, grad=True):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)

    weights = tuple(t(o, width, grad=train_base) for o in outs)
    biases = tuple(t(o, grad=train_base) for o in outs) if bias else ()
    lora_as = tuple(t(r, width) for r in ranks)
    lora_bs = tuple(t(o, r) for o, r in zip(outs, ranks))
    return weights, biases, lora_as, lora_bs


@pytest.mark.parametrize(
    ("outs", "ranks", "bias", "train_base"),
    [
        ((7,), (3,), True, False),
        ((11, 5, 5), (2, 3, 1), False, False),
        ((6, 6), (2, 2), True, True),
    ],
    ids=["one-layer", "q-k-v", "base-trained"],
)
def test_the_joined_node_gives_float64_gradients(outs, ranks, bias, train_base):
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, 13, torch.float64, bias, train_base)
    scalings = tuple(0.5 + i for i in range(len(outs)))  # each layer its own
    x = torch.randn(2, 3, 13, dtype=torch.float64, device=DEVICE, requires_grad=True)
    n, nb = len(outs), len(biases)

    def joined(x, *params):
        w, b = params[:n], params[n : n + nb]
        a, lb = params[n + nb : 2 * n + nb], params[2 * n + nb :]
        return torch.cat(lora_projections(x, w, b, a, lb, scalings), dim=-1)

    params = (*weights, *biases, *lora_as, *lora_bs)
    assert torch.autograd.gradcheck(joined, (x, *params))
    want = torch_lora_projections(x, weights, biases, lora_as, lora_bs, scalings)
    for got, expected in zip(
        lora_projections(x, weights, biases, lora_as, lora_bs, scalings), want
    ):
        torch.testing.assert_close(got, expected)


def test_with_dropped_inputs_the_adapters_read_them_and_gradients_reach_x_through_them():
    # Each adapter reads its own dropped input (a fixed mask here, so gradcheck sees a
    # function); x reaches the bases directly and the adapters through the masks.
    outs, ranks = (5, 4, 4), (2, 3, 1)
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, 7, torch.float64, True, False)
    scalings = (0.5, 2.0, 1.5)
    g = torch.Generator().manual_seed(5)
    masks = [(torch.rand(2, 3, 7, generator=g) > 0.3).to(DEVICE, torch.float64) / 0.7 for _ in outs]
    x = torch.randn(2, 3, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def joined(x, *adapters):
        a, lb = adapters[:3], adapters[3:]
        dropped = tuple(x * m for m in masks)
        return torch.cat(
            lora_projections(x, weights, biases, a, lb, scalings, dropped=dropped), dim=-1
        )

    assert torch.autograd.gradcheck(joined, (x, *lora_as, *lora_bs))
    dropped = tuple(x * m for m in masks)
    want = torch_lora_projections(x, weights, biases, lora_as, lora_bs, scalings, dropped=dropped)
    got = lora_projections(x, weights, biases, lora_as, lora_bs, scalings, dropped=dropped)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bias", [True, False])
def test_under_bf16_autocast_it_stays_near_float64_and_a_frozen_base_gets_no_gradient(bias):
    outs, ranks, width = (29, 13, 13), (3, 5, 2), 37
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, width, torch.float32, bias, False)
    scalings = (2.0, 0.25, 1.0)
    x = torch.randn(3, 7, width, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        outputs = lora_projections(x, weights, biases, lora_as, lora_bs, scalings)
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    sum(o.float().square().sum() for o in outputs).backward()

    def double(ts):
        return tuple(t.detach().double().requires_grad_(t.requires_grad) for t in ts)

    x64, w64, b64, a64, lb64 = double((x,)), *map(double, (weights, biases, lora_as, lora_bs))
    want = torch_lora_projections(x64[0], w64, b64, a64, lb64, scalings)
    sum(o.square().sum() for o in want).backward()
    for got, expected in [
        *zip(outputs, want),
        (x.grad, x64[0].grad),
        *((p.grad, q.grad) for p, q in zip((*lora_as, *lora_bs), (*a64, *lb64))),
    ]:
        error = (got.double() - expected).norm() / expected.norm()
        assert error < 2e-2, error
    assert all(p.grad is None for p in (*weights, *biases))  # the frozen base
    assert all(p.grad.dtype == torch.float32 for p in (*lora_as, *lora_bs))

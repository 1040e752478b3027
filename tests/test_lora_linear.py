"""The lora_linear op's kernel (ops/lora_linear.py): one node for a LoRA layer or a group
of them on one input, forward and backward against a float64 reference (gradcheck), and
under bf16 autocast against float64 on shapes of primes, with the base frozen or not."""

import pytest

torch = pytest.importorskip("torch")

from xpuruntime.pytorch._ops.lora_linear import (  # noqa: E402
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
@pytest.mark.parametrize("shared", [False, True], ids=["own-scales", "one-scale"])
def test_the_joined_node_gives_float64_gradients(outs, ranks, bias, train_base, shared):
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, 13, torch.float64, bias, train_base)
    # Each layer its own scale, or one for the group (peft's usual, by the GEMMs' alpha)
    scalings = (1.5,) * len(outs) if shared else tuple(0.5 + i for i in range(len(outs)))
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


def _masked_reference(x, weights, biases, lora_as, lora_bs, scalings, p):
    """What the fused op computes with dropout ``p``, in float64, from the masks the call
    drew (the seed drawn again from the same generator state)."""
    from xpuruntime.pytorch._ops._infra._lora_dropout import draw_seed, keep_masks

    seed = draw_seed(x.device)
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    masks = keep_masks(seed, len(weights), rows, width, p).view(len(weights), *x.shape)
    outs = []
    for i, (w, a, lb, s) in enumerate(zip(weights, lora_as, lora_bs, scalings)):
        b = biases[i] if biases else None
        dropped = x * masks[i] / (1 - p)
        outs.append(torch.nn.functional.linear(x, w, b) + (dropped @ a.t() @ lb.t()) * s)
    return outs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scalings", [(0.5, 2.0, 1.5), (2.0, 2.0, 2.0)], ids=["own", "one"])
def test_with_dropout_the_adapters_read_x_through_masks_drawn_in_the_kernels(dtype, scalings):
    """Each adapter's mask is drawn from the call's seed (one draw of the generator):
    the output and every gradient are those of x times the masks, the masks change with
    the generator's state, and each keeps about 1 - p of the elements."""
    outs, ranks, width, p = (5, 4, 4), (2, 2, 2), 13, 0.3
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, width, dtype, True, False)
    dropout = tuple((p, None) for _ in outs)
    x = torch.randn(2, 33, width, dtype=dtype, device=DEVICE, requires_grad=True)

    def fused(x, *adapters):
        torch.manual_seed(7)  # the same draw on every call gradcheck makes
        a, lb = adapters[:3], adapters[3:]
        return torch.cat(
            lora_projections(x, weights, biases, a, lb, scalings, dropout=dropout), dim=-1
        )

    if dtype == torch.float64:  # a small input: each check runs the kernels again
        small = x[:1, :3, :].detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(fused, (small, *lora_as, *lora_bs))
    got = fused(x, *lora_as, *lora_bs)
    got.square().sum().backward()
    torch.manual_seed(7)
    leaves = [t.detach().double().requires_grad_() for t in (x, *lora_as, *lora_bs)]
    x64, a64, lb64 = leaves[0], leaves[1:4], leaves[4:]
    w64, b64 = tuple(w.double() for w in weights), tuple(b.double() for b in biases)
    want = torch.cat(_masked_reference(x64, w64, b64, a64, lb64, scalings, p), dim=-1)
    want.square().sum().backward()

    def close(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-3)
            return
        # On a GPU p and 1 / (1 - p) reach the kernels as fp32 numbers (Triton's type
        # for a Python float; the interpreter keeps fp64): their rounding is relative to
        # the largest term, and x's gradient sums terms of about 1e3 that can cancel.
        atol = 1e-6 * (want.abs().max().item() if DEVICE == "cuda" else 1.0)
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-5)

    close(got, want)
    for t, ref in zip((x, *lora_as, *lora_bs), leaves):
        close(t.grad, ref.grad)
    torch.manual_seed(8)  # another state of the generator: other masks
    other = lora_projections(x, weights, biases, lora_as, lora_bs, scalings, dropout=dropout)
    assert not torch.equal(torch.cat(other, dim=-1), got)
    from xpuruntime.pytorch._ops._infra._lora_dropout import keep_masks

    seed = torch.tensor([11], dtype=torch.int64, device=DEVICE)
    kept = keep_masks(seed, 3, 200, 300, p).float().mean(dim=(1, 2))
    assert torch.allclose(kept, torch.full_like(kept, 1 - p), atol=0.01), kept


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("train_base", [False, True], ids=["frozen", "base-trained"])
def test_a_layer_without_an_adapter_joins_a_group_as_its_base_alone(p, train_base):
    """q and v with adapters, k without one (a 4-bit base peft left bare): one node whose
    k output is its base GEMM alone; float64 gradients, and with dropout the masks of the
    adapted layers only, drawn as for a group of those."""
    outs, ranks, width = (5, 4, 4), (2, 2, 2), 13
    weights, _, lora_as, lora_bs = _layers(outs, ranks, width, torch.float64, False, train_base)
    lora_as, lora_bs = (lora_as[0], None, lora_as[2]), (lora_bs[0], None, lora_bs[2])
    scalings, dropout = (1.5, 0.0, 1.5), ((p, None), (0.0, None), (p, None)) if p else ()
    x = torch.randn(2, 3, width, dtype=torch.float64, device=DEVICE, requires_grad=True)
    trained = (lora_as[0], lora_as[2], lora_bs[0], lora_bs[2])

    def joined(x, *params):
        torch.manual_seed(7)  # the same draw on every call gradcheck makes
        w, (a0, a2, b0, b2) = params[:3], params[3:]
        outs = lora_projections(x, w, (), (a0, None, a2), (b0, None, b2), scalings,
                                dropout=dropout)  # fmt: skip
        return torch.cat(outs, dim=-1)

    small = x[:1, :2].detach().clone().requires_grad_()  # (each check runs the kernels)
    assert torch.autograd.gradcheck(joined, (small, *weights, *trained))
    torch.manual_seed(7)
    if p:
        want = _masked_reference(x, weights[::2], (), lora_as[::2], lora_bs[::2], (1.5, 1.5), p)
        want.insert(1, torch.nn.functional.linear(x, weights[1]))
    else:
        want = torch_lora_projections(x, weights, (), lora_as, lora_bs, scalings)
    got, want = joined(x, *weights, *trained), torch.cat(want, dim=-1)
    if p and DEVICE == "cuda":  # (p and 1 / (1 - p) reach the kernels as fp32 numbers)
        atol = 1e-6 * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want)


def test_dropout_the_kernels_do_not_draw_is_refused_by_name():
    from xpuruntime import UnsupportedOperationError

    weights, _, lora_as, lora_bs = _layers((4, 4), (2, 3), 8, torch.float32, False, False)
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(UnsupportedOperationError, match="different ranks"):
        lora_projections(x, weights, (), lora_as, lora_bs, (1.0, 1.0), dropout=((0.1, None),) * 2)


@pytest.mark.parametrize("scalings", [(2.0, 0.25, 1.0), (2.0, 2.0, 2.0)], ids=["own", "one"])
@pytest.mark.parametrize("bias", [True, False])
def test_under_bf16_autocast_it_stays_near_float64_and_a_frozen_base_gets_no_gradient(
    bias, scalings
):
    outs, ranks, width = (29, 13, 13), (3, 5, 2), 37
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, width, torch.float32, bias, False)
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


def test_one_layers_output_is_the_node_itself_so_its_backward_copies_no_gradient():
    """A single LoRA layer (o, down) gets the node's output, not a split of it: autograd
    undoes a split of one part by a cat of the whole gradient, a copy of an activation's
    size in every backward. A group's outputs are views of the one output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Cats.count += func.overloadpacket is torch.ops.aten.cat
            return func(*args, **(kwargs or {}))

    for outs, ranks in (((7,), (3,)), ((11, 5, 5), (2, 3, 1))):
        weights, biases, lora_as, lora_bs = _layers(outs, ranks, 13, torch.float32, False, False)
        x = torch.randn(4, 13, device=DEVICE, requires_grad=True)
        scales = (0.5,) * len(outs)
        ys = lora_projections(x, weights, biases, lora_as, lora_bs, scales)
        assert (ys[0]._base is None) == (len(outs) == 1)
        loss = sum((y * torch.arange(y.shape[-1], device=DEVICE)).sum() for y in ys)
        Cats.count = 0
        with Cats():
            loss.backward()
        assert Cats.count == 0 or len(outs) > 1
        want = torch_lora_projections(x.detach(), weights, biases, lora_as, lora_bs, scales)
        for y, w in zip(ys, want):
            torch.testing.assert_close(y, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["gate-up", "packed"])
@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_a_down_adapters_gradient_is_read_from_gate_and_up_without_making_h(
    kind, packed, dtype, monkeypatch
):
    """After a gated activation (a LoRA MLP's down projection), the adapter's gradient
    ``dA = ds^T h`` comes from gate and up by the activation's own kernel, ``h`` never
    made again; equal to the product over ``h`` kept. A training base needs ``h`` for its
    own gradient, so it is made again there."""
    pytest.importorskip("triton")
    from xpuruntime.pytorch._ops import swiglu as activations

    made = []

    def counted(launcher):
        def launch(*inputs):
            made.append(1)
            return launcher(*inputs)

        return launch

    again = {name: counted(launcher) for name, launcher in activations._AGAIN.items()}
    monkeypatch.setattr(activations, "_AGAIN", again)
    run = activations.run_swiglu if kind == "swiglu" else activations.run_geglu
    g = torch.Generator().manual_seed(0)
    rows, width, out, rank = 70, 48, 24, 5  # two row splits; a rank under a dot's 16

    def grads(keep_h: bool, train_base: bool) -> tuple:
        gate = torch.randn(rows, width * (2 if packed else 1), generator=g).to(DEVICE, dtype)
        up = None if packed else torch.randn(rows, width, generator=g).to(DEVICE, dtype)
        gate.requires_grad_()
        h = run(gate) if packed else run(gate, up.requires_grad_())
        if keep_h:  # the same values, not marked: the op keeps them
            h = h.detach().clone().requires_grad_()
        (w,), _, (a,), (b,) = _layers((out,), (rank,), width, dtype, False, train_base)
        y = lora_projections(h, (w,), (), (a,), (b,), (0.5,))[0]
        (y.float() * torch.linspace(-1, 1, out, device=DEVICE)).sum().backward()
        return a.grad, b.grad, gate.grad if not keep_h else None

    for train_base in (False, True):
        g.manual_seed(1)
        made.clear()
        got = grads(keep_h=False, train_base=train_base)
        assert bool(made) == train_base
        g.manual_seed(1)
        want = grads(keep_h=True, train_base=train_base)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[1])


def test_an_adapter_wider_than_the_products_kernel_takes_makes_h_again():
    """A rank above what the left-product kernel holds (64) makes the SwiGLU's output
    again for a GEMM, as before; its gradients stay peft's."""
    pytest.importorskip("triton")
    from xpuruntime.pytorch._ops import swiglu as activations

    gate, up = (torch.randn(20, 32, device=DEVICE, requires_grad=True) for _ in "gu")
    h = activations.run_swiglu(gate, up)
    assert activations._left_product(False, torch.ones(20, 80, device=DEVICE), gate, up) is None
    (w,), _, (a,), (b,) = _layers((8,), (80,), 32, torch.float32, False, False)
    lora_projections(h, (w,), (), (a,), (b,), (0.5,))[0].sum().backward()
    a2 = a.detach().requires_grad_()
    torch_lora_projections(h.detach(), (w,), (), (a2,), (b,), (0.5,))[0].sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("ranks", "sizes", "scales"),
    [((16, 16, 16), (64, 32, 32), (2.0, 2.0, 2.0)), ((8, 4), (40, 24), (2.0, 0.5)),
     ((16, 8, 8), (17, 5, 9), (0.3, 3.0, 1.7))],
    ids=["q-k-v", "gate-up", "odd-sizes-own-scales"],
)  # fmt: skip
def test_one_launch_packs_a_groups_adapters_as_cat_and_block_diagonal(
    ranks, sizes, scales, source, out
):
    from xpuruntime.pytorch._ops._infra import _launch
    from xpuruntime.pytorch._ops._infra._adapter_pack import pack_adapters

    g = torch.Generator().manual_seed(0)
    lora_as = tuple(torch.randn(r, 48, generator=g).to(DEVICE, source) for r in ranks)
    lora_bs = tuple(torch.randn(n, r, generator=g).to(DEVICE, source) for n, r in zip(sizes, ranks))
    packed = pack_adapters(lora_as, lora_bs, scales, out)
    if out == torch.bfloat16 and _launch.interpreting():
        assert packed is None  # the interpreter rounds to bf16 toward zero: not run there
        return
    assert packed is not None
    a, diag = packed
    want_a = torch.cat([t.double() for t in lora_as])
    # (scaled in fp32, as the kernel scales)
    want_diag = torch.block_diag(*[b.float() * s for b, s in zip(lora_bs, scales)]).double()
    for got, want in ((a, want_a), (diag, want_diag)):  # each element cast once, to nearest
        assert got.dtype == out and got.shape == want.shape
        torch.testing.assert_close(got, want.to(out), rtol=0, atol=0)
    assert (diag.double() != 0).sum() <= sum(n * r for n, r in zip(sizes, ranks))


@pytest.mark.parametrize("bare", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_layer_without_an_adapter_packs_as_zero_rows_of_the_block_diagonal(bare):
    """A 4-bit layer peft left without an adapter, joined with adapted ones: no rows of
    the joined A, and its output's rows of the block diagonal zero; by the one launch
    and by PyTorch's calls alike."""
    from xpuruntime.pytorch._ops._infra._adapter_pack import pack_adapters
    from xpuruntime.pytorch._ops.lora_linear import _packed

    g = torch.Generator().manual_seed(0)
    sizes, ranks, scales = (40, 24, 16), (8, 4, 4), (2.0, 0.5, 1.5)
    lora_as = [torch.randn(r, 48, generator=g).to(DEVICE) for r in ranks]
    lora_bs = [torch.randn(n, r, generator=g).to(DEVICE) for n, r in zip(sizes, ranks)]
    lora_as[bare] = lora_bs[bare] = None
    want_a = torch.cat([a.double() for a in lora_as if a is not None])
    want_diag = torch.zeros(sum(sizes), want_a.shape[0], dtype=torch.float64, device=DEVICE)
    row = col = 0
    for b, s, n in zip(lora_bs, scales, sizes):
        if b is not None:
            want_diag[row : row + n, col : col + b.shape[1]] = (b.float() * s).double()
            col += b.shape[1]
        row += n
    launched = pack_adapters(tuple(lora_as), tuple(lora_bs), scales, torch.float16, sizes)
    # (in fp32 the launch declines: PyTorch's calls)
    written = _packed(tuple(lora_as), tuple(lora_bs), scales, None, sizes, torch.float32)
    for (a, diag), dtype in ((launched, torch.float16), (written, torch.float32)):
        torch.testing.assert_close(a, want_a.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(diag, want_diag.to(dtype), rtol=0, atol=0)
    assert pack_adapters((None, None), (None, None), (0.0, 0.0), torch.float16, (8, 8)) is None


def test_adapters_pack_declines_what_one_launch_does_not_take():
    from xpuruntime.pytorch._ops._infra._adapter_pack import pack_adapters

    a, b = torch.randn(4, 8, device=DEVICE), torch.randn(6, 4, device=DEVICE)
    assert pack_adapters((a,), (b,), (1.0,), torch.float16) is None  # one adapter
    assert pack_adapters((a,) * 4, (b,) * 4, (1.0,) * 4, torch.float16) is None  # four
    wide = torch.randn(200, 8, device=DEVICE), torch.randn(6, 200, device=DEVICE)
    assert pack_adapters((wide[0],) * 2, (wide[1],) * 2, (1.0,) * 2, torch.float16) is None
    strided = torch.randn(8, 4, device=DEVICE).t()
    assert pack_adapters((a, strided), (b, b), (1.0, 1.0), torch.float16) is None
    for dtype in (torch.float32, torch.float64):  # GEMMs outside autocast: PyTorch's cat
        assert pack_adapters((a, a), (b, b), (1.0, 1.0), dtype) is None
    assert pack_adapters((a, a), (b, b), (1.0, 1.0), torch.float16) is not None


@pytest.mark.parametrize("scalings", [(2.0, 2.0, 2.0), (0.5, 1.5, 2.5)], ids=["one", "own"])
def test_a_group_in_fp16_runs_on_its_packed_adapters_near_float64(scalings, monkeypatch):
    """The op's forward takes its A and diag(s_i B_i) from one pack launch where it runs
    (fp16 runs in the interpreter too; bf16 on a GPU): outputs and gradients as peft's
    chain computes them in float64."""
    from xpuruntime.pytorch._ops._infra import _adapter_pack

    packs = []
    pack = _adapter_pack.pack_adapters

    def counted(*args):
        packed = pack(*args)
        packs.append(packed is not None)
        return packed

    monkeypatch.setattr(_adapter_pack, "pack_adapters", counted)
    outs, ranks, width = (29, 13, 13), (3, 5, 2), 37
    weights, biases, lora_as, lora_bs = _layers(outs, ranks, width, torch.float32, False, False)
    x = torch.randn(3, 7, width, device=DEVICE, requires_grad=True)
    outputs = lora_projections(x, weights, biases, lora_as, lora_bs, scalings, torch.float16)
    assert packs == [True]
    sum(o.float().square().sum() for o in outputs).backward()

    def double(ts):
        return tuple(t.detach().double().requires_grad_(t.requires_grad) for t in ts)

    x64, w64, a64, lb64 = double((x,)), *map(double, (weights, lora_as, lora_bs))
    want = torch_lora_projections(x64[0], w64, (), a64, lb64, scalings)
    sum(o.square().sum() for o in want).backward()
    for got, expected in [
        *zip(outputs, want),
        (x.grad, x64[0].grad),
        *((p.grad, q.grad) for p, q in zip((*lora_as, *lora_bs), (*a64, *lb64))),
    ]:
        error = (got.double() - expected).norm() / expected.norm()
        assert error < 5e-3, error

"""The gated MLPs' activation keeping gate and up in FP8 for the backward (issue 67, the
policy's ``fp8_activations``): the backward, the recomputed activation and its left
product are the float64 values of the same rounded inputs, the 16-bit inputs are held by
nothing after the forward, ``optimize`` routes a peft Llama's activations there under an
FP8 precision (its loss unchanged, its gradients near bf16's) and refuses the option,
with the reason, where it cannot act. The kernels run under Triton's interpreter here;
on an FP8 GPU the same tests run compiled."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tiny_configs import SMALL  # noqa: E402

from xpuruntime import BackendUnavailableError, PolicyError  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.policies import KernelPolicy  # noqa: E402
from xpuruntime.pytorch._ops import swiglu as gated  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import triton_unavailable  # noqa: E402
from xpuruntime.pytorch._ops._infra._recompute import recomputable  # noqa: E402
from xpuruntime.pytorch._selection._routed import ROUTED_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable(torch.device(DEVICE)) is not None
    or (DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9)),
    reason="FP8 or Triton does not run here",
)


def _rounded_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows of its last dimension) as kept: e4m3 with one scale per row (its
    amax at 448), in float64."""
    rows = t.detach().float().reshape(-1, t.shape[-1])
    amax = rows.abs().amax(1, keepdim=True).clamp(min=1e-12)
    q = (rows * (torch.full_like(amax, 448.0) / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.double() * (amax / 448).double()).view(t.shape)


def _act(g: torch.Tensor, gelu: bool) -> torch.Tensor:
    return torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "apart"])
def test_the_backward_is_the_float64_gradient_of_the_inputs_as_kept(gelu, packed):
    """The forward is the plain fused pass (``h`` from the inputs as given); the
    backward is float64's gradient at gate and up rounded to e4m3 per row (a packed
    pair shares its row's scale), written in the inputs' dtype."""
    g = torch.Generator().manual_seed(0)
    shape = (3, 5, 96)
    values = torch.randn((*shape[:-1], 2 * shape[-1]), generator=g) * 2
    values[0, 0] *= 40  # rows of other magnitudes: the scale is each row's
    values = values.to(DEVICE, torch.bfloat16)
    dh = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
    name = "geglu" if gelu else "swiglu"
    if packed:
        pair = values.clone().requires_grad_()
        h = gated.run_fp8_kept(name, pair)
        kept = _rounded_rows(pair)
        gate, up = kept.chunk(2, -1)
        inputs = (pair,)
    else:
        gate_in, up_in = (t.contiguous().requires_grad_() for t in values.chunk(2, -1))
        h = gated.run_fp8_kept(name, gate_in, up_in)
        gate, up = _rounded_rows(gate_in), _rounded_rows(up_in)
        inputs = (gate_in, up_in)
    plain = gated.run_geglu if gelu else gated.run_swiglu
    want_h = plain(*(t.detach() for t in inputs))
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)

    h.backward(dh)
    gate64 = gate.clone().requires_grad_()
    up64 = up.clone().requires_grad_()
    (_act(gate64, gelu) * up64).backward(dh.double())
    if packed:
        grads, wants = (inputs[0].grad,), (torch.cat([gate64.grad, up64.grad], -1),)
    else:
        grads, wants = (inputs[0].grad, inputs[1].grad), (gate64.grad, up64.grad)
    for got, want in zip(grads, wants):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "apart"])
def test_what_is_kept_is_the_per_row_cast_the_fp8_gemms_make(packed):
    """The forward's one launch keeps the same bits and scales as the per-row cast
    (``fp8.quantize``) of each input (a packed pair's row as one), and of ``h`` where
    asked, over rows wider than one block of the kernel, an odd number of them, one all
    zeros."""
    from xpuruntime.pytorch._ops.fp8 import E4M3, quantize

    g = torch.Generator().manual_seed(2)
    values = torch.randn(7, 2 * 1100, generator=g) * 5
    values[3] = 0.0
    values[5, :1100] *= 300  # a gate row far larger than its up row
    values = values.to(DEVICE, torch.bfloat16)
    inputs = (values,) if packed else tuple(t.contiguous() for t in values.chunk(2, -1))
    up = () if not packed else (None,)
    h, *kept = gated._KeptFp8.apply(*inputs, *up, "swiglu", None, True)
    assert h.shape == (7, 1100) and len(kept) == 2 * len(inputs) + 2
    for i, t in enumerate((*inputs, h)):
        q, _, scale = quantize(t, E4M3, "row")
        assert torch.equal(kept[2 * i].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(kept[2 * i + 1], scale)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "apart"])
def test_the_next_projection_makes_the_activation_again_from_the_kept_inputs(packed):
    """What a following LoRA op reads in its backward (``ops._recompute``): ``h`` made
    again, and ``m^T h`` without making it, both from the kept FP8 inputs."""
    g = torch.Generator().manual_seed(1)
    values = (torch.randn(64, 2 * 80, generator=g) * 3).to(DEVICE, torch.bfloat16)
    if packed:
        inputs = (values.clone().requires_grad_(),)
        gate, up = _rounded_rows(inputs[0]).chunk(2, -1)
    else:
        inputs = tuple(t.contiguous().requires_grad_() for t in values.chunk(2, -1))
        gate, up = (_rounded_rows(t) for t in inputs)
    h = gated.run_fp8_kept("swiglu", *inputs)
    again = recomputable(h)
    assert again is not None and all(t.dtype != torch.bfloat16 for t in again.inputs[::2])
    want = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    made = again.function(*again.inputs)
    assert made.dtype == torch.bfloat16
    # (one bf16 step: the interpreter truncates where the GPU rounds)
    torch.testing.assert_close(made.double(), want.double(), rtol=2**-7, atol=1e-6)
    m = torch.randn(64, 16, generator=g).to(DEVICE, torch.bfloat16)
    product = again.product(m, *again.inputs)  # (h rounded as made again)
    want_product = m.double().t() @ made.double()
    torch.testing.assert_close(product.double(), want_product, rtol=1e-3,
                               atol=1e-3 * want_product.abs().max())  # fmt: skip


@pytest.mark.parametrize("kept", [True, False], ids=["fp8", "fused"])
def test_the_16_bit_inputs_are_held_by_nothing_after_the_forward(kept):
    """Kept in FP8, the activation's 16-bit inputs (one GEMM's output in a model) are
    freed once the forward is done with them; the plain fused pass keeps them."""
    x = torch.randn(32, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    pair = x * 2  # (an op's output: autograd keeps nothing of it for MulBackward)
    h = gated.run_fp8_kept("swiglu", pair) if kept else gated.run_swiglu(pair)
    held = weakref.ref(pair)
    del pair
    gc.collect()
    assert (held() is None) == kept
    h.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def _peft_llama():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", **{**SMALL, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def _step(policy, checkpointed=False):
    model = _peft_llama()
    if checkpointed:
        model.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    report = xpt.optimize(model, policy)
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten().float() for n, p in model.named_parameters()
                           if "lora_" in n])  # fmt: skip
        chosen = {d.chosen for d in ROUTED_OPS["swiglu"].decisions.values()}
        return loss.item(), grads, report, chosen
    finally:
        report.revert()


def test_an_fp8_policy_keeps_a_peft_llamas_gate_and_up_in_fp8(fp8_here):
    """Under ``precision='fp8'`` with ``fp8_activations`` the activations run the
    ``fp8`` kernel, the report lists the MLPs, the loss is the one without it (the
    forward reads the inputs as given) and the adapters' gradients are near it."""
    want_loss, want_grads, report, chosen = _step({"precision": "fp8"})
    assert chosen == {"fused"} and report.fp8_activations == []
    loss, grads, report, chosen = _step({"precision": "fp8", "fp8_activations": True})
    assert chosen == {"fp8"}
    assert report.fp8_activations == [f"base_model.model.model.layers.{i}.mlp" for i in (0, 1)]
    assert loss == want_loss
    assert (grads - want_grads).norm() < 0.05 * want_grads.norm()


@pytest.mark.parametrize("stored", [False, True], ids=["cast-bases", "stored-bases"])
def test_gate_and_up_kept_in_fp8_train_the_same_checkpointed(fp8_here, stored):
    """Under transformers' gradient checkpointing the layers' forwards run again in the
    backward, keeping gate and up in FP8 again (over stored bases, handing the MLP's
    projections their casts again): the same loss and adapter gradients."""
    policy = {"precision": "fp8", "fp8_activations": True, "fp8_base": stored}
    want_loss, want_grads, _, _ = _step(policy)
    loss, grads, report, chosen = _step(policy, checkpointed=True)
    assert chosen == {"fp8"} and len(report.fp8_activations) == 2
    assert loss == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(grads, want_grads, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("stored", [False, True], ids=["cast-bases", "stored-bases"])
def test_a_model_compiled_on_its_first_call_trains_as_the_eager_one(fp8_here, stored):
    """``torch.compile`` after ``optimize`` with ``fp8_activations`` (over stored bases
    too, where the eager step hands the MLP's projections their casts and the graph
    does not): the graph computes the activation as written (keeping what it
    computes), and the step gives the eager step's loss and near its gradients."""
    policy = {"precision": "fp8", "fp8_activations": True, "fp8_base": stored}
    model = _peft_llama()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    report = xpt.optimize(model, policy)
    try:
        results = []
        for forward in (model, torch.compile(model)):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.item(), torch.cat([p.grad.flatten().float() for n, p in
                            model.named_parameters() if "lora_" in n])))  # fmt: skip
            model.zero_grad()
    finally:
        report.revert()
        torch._dynamo.reset()
    (eager_loss, eager_grads), (loss, grads) = results
    assert abs(loss - eager_loss) < 1e-3 * eager_loss
    assert torch.nn.functional.cosine_similarity(grads, eager_grads, dim=0) > 0.99


def test_fp8_activations_are_refused_with_the_reason_where_they_cannot_act(fp8_here):
    """Without an FP8 precision: ``PolicyError`` under strict, else a line and the
    activation's inputs kept as they are; a policy naming another kernel is told so."""
    model = _peft_llama()
    with pytest.raises(PolicyError, match="fp8_activations: needs precision='fp8'"):
        xpt.optimize(model, {"fp8_activations": True, "strict": True})
    _, _, report, chosen = _step({"fp8_activations": True})
    assert chosen == {"fused"} and report.fp8_activations == []
    assert any("fp8_activations: needs precision" in said for _, said in report.skipped)
    policy = {"precision": "fp8", "fp8_activations": True, "kernels": {"swiglu": "fused"}}
    _, _, report, chosen = _step(policy)
    assert chosen == {"fused"} and report.fp8_activations == []
    assert any("names the kernel of swiglu" in said for _, said in report.skipped)


@pytest.mark.skipif(DEVICE != "cpu", reason="the refusal of a device without FP8")
def test_a_device_without_fp8_refuses_fp8_activations():
    model = _peft_llama()
    with pytest.raises(BackendUnavailableError, match="fp8_activations: FP8 GEMMs need"):
        xpt.optimize(model, {"precision": "fp8", "fp8_activations": True, "strict": True})


def test_the_policy_takes_saves_and_shows_fp8_activations(tmp_path):
    policy = KernelPolicy(precision="fp8", fp8_activations=True)
    policy.save(tmp_path / "p.json")
    assert KernelPolicy.load(tmp_path / "p.json") == policy
    assert "fp8_activations=True" in repr(policy)
    assert "fp8_activations" not in KernelPolicy(precision="fp8").to_dict()
    with pytest.raises(PolicyError, match="fp8_activations: expected True or False"):
        KernelPolicy(fp8_activations="yes")


def test_a_handed_cast_or_amax_is_refused_once_anything_it_was_made_from_is_written():
    """What an op hands the next (``_fp8_handoff``) is keyed on the tensor's version and
    shape, an amax also on its scales: a write after it was made refuses it."""
    from xpuruntime.pytorch._ops._infra import _fp8_handoff as handoff
    from xpuruntime.pytorch._ops.fp8 import E4M3, quantize

    h = torch.randn(4, 32, device=DEVICE, dtype=torch.bfloat16)
    q, _, inverse = quantize(h, E4M3, "row")
    handoff.hand_cast(h, q, inverse)
    assert handoff.handed_cast(h)[0] is q
    assert handoff.handed_cast(h.view(2, 2, 32)) is None  # (a view: its own object)
    h.mul_(2)
    assert handoff.handed_cast(h) is None

    grad = torch.randn(4, 32, device=DEVICE)
    scales = torch.rand(32, device=DEVICE)
    parts = (grad * scales).abs().view(4, 2, 16).amax(-1)
    handoff.hand_amax(grad, parts, scales)
    assert handoff.handed_amax(grad, scales) is parts
    assert handoff.handed_amax(grad, scales.clone()) is None  # other scales
    scales.mul_(2)
    assert handoff.handed_amax(grad, scales) is None
    handoff.hand_amax(grad, parts, scales)
    grad.add_(1)
    assert handoff.handed_amax(grad, scales) is None


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
def test_the_backward_finding_the_amax_writes_the_same_gradient_and_the_cast_its_bits(gelu):
    """Asked for each row's amax of the pair's gradient times the scales, the backward
    writes the gradient it writes without; the per-row cast given those parts writes
    the bits and scales of the cast that finds the amax itself. Over rows wider than a
    program's block, an odd number of them, one of zeros."""
    from xpuruntime.pytorch._ops.fp8 import E4M3, quantize

    g = torch.Generator().manual_seed(4)
    pair = (torch.randn(5, 2 * 1100, generator=g) * 3).to(DEVICE, torch.bfloat16)
    dh = torch.randn(5, 1100, generator=g).to(DEVICE, torch.bfloat16)
    dh[2] = 0.0
    scales = (torch.rand(2 * 1100, generator=g) * 1e-2).to(DEVICE)
    _, kept, _ = gated._kept_forward(gelu, pair, None, False)
    want, _, none = gated._kept_backward(gelu, dh, pair.shape, pair.dtype, kept, None)
    grad, _, parts = gated._kept_backward(gelu, dh, pair.shape, pair.dtype, kept, scales)
    assert none is None and torch.equal(grad, want)
    assert parts.shape[0] == 5 and parts.shape[1] > 1
    torch.testing.assert_close(parts.amax(1), (want.float() * scales).abs().amax(1), rtol=0, atol=0)
    q, _, inverse = quantize(want, E4M3, "row", multiplier=scales)
    given, _, given_inverse = quantize(want, E4M3, "row", multiplier=scales, amax=parts)
    assert torch.equal(given.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(given_inverse, inverse)


def test_over_stored_bases_the_activation_hands_the_projections_their_casts(fp8_here, monkeypatch):
    """Under ``fp8_base`` the activation writes ``h``'s per-token cast for the down
    projection, and in its backward each row's amax of the gate/up gradient times the
    bases' row scales for the projection before. Each is what that projection would
    have found (the same bits), so the step's loss and adapter gradients are those of
    the step without them, bit for bit."""
    from xpuruntime.pytorch._ops import lora_linear
    from xpuruntime.pytorch._ops.fp8 import E4M3, quantize

    handed_cast, handed_amax = lora_linear.handed_cast, lora_linear.handed_amax
    seen = {"cast": 0, "amax": 0}

    def checked_cast(x):
        cast = handed_cast(x)
        if cast is not None:
            q, _, inverse = quantize(x.reshape(-1, x.shape[-1]), E4M3, "row")
            assert torch.equal(cast[0].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(cast[1], inverse)
            seen["cast"] += 1
        return cast

    def checked_amax(grad, scales):
        parts = handed_amax(grad, scales)
        if parts is not None:
            want = (grad.reshape(-1, grad.shape[-1]).float() * scales).abs().amax(-1)
            assert torch.equal(parts.amax(1), want)
            seen["amax"] += 1
        return parts

    policy = {"precision": "fp8", "fp8_base": True, "fp8_activations": True}
    monkeypatch.setattr(lora_linear, "handed_cast", checked_cast)
    monkeypatch.setattr(lora_linear, "handed_amax", checked_amax)
    loss, grads, report, chosen = _step(policy)
    assert chosen == {"fp8"} and len(report.fp8_bases) == 14
    assert seen == {"cast": 2, "amax": 2}  # (each layer's down and gate/up projections)
    monkeypatch.setattr(lora_linear, "handed_cast", lambda x: None)
    monkeypatch.setattr(lora_linear, "handed_amax", lambda grad, scales: None)
    want_loss, want_grads, _, _ = _step(policy)
    assert loss == want_loss
    assert torch.equal(grads, want_grads)

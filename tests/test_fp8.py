"""FP8 GEMMs (issue 67): the casts against PyTorch's own casts of the same scaled
values (to the bit), the layer's output and gradients against a float64 product of the
same quantized operands, and the policy's ``precision='fp8'``: saved, explained, and
refused on a device without FP8 (strict: BackendUnavailableError; otherwise bf16, the
reason in the log)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from xpuruntime import BackendUnavailableError, UnsupportedOperationError  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.policies import KernelPolicy  # noqa: E402
from xpuruntime.pytorch._ops import fp8  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import triton_unavailable  # noqa: E402
from xpuruntime.pytorch._selection._routed import ROUTED_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    triton_unavailable(torch.device(DEVICE)) is not None, reason="Triton runs nothing here"
)


def _reference_cast(t: torch.Tensor, dtype: torch.dtype, per: str):
    """PyTorch's cast of ``t`` scaled into the format's range, and the inverse scale."""
    top = torch.finfo(dtype).max
    t = t.double()
    if per == "tensor":
        amax = t.abs().max()
    else:
        amax = t.abs().amax(dim=1 if per == "row" else 0, keepdim=True)
    amax = amax.float().clamp(min=1e-12)
    # An fp32 division (``top / amax`` with a Python ``top`` multiplies by a reciprocal).
    scale = torch.full_like(amax, top) / amax
    scaled = (t.float() * scale).clamp(-top, top)
    return scaled.to(dtype), amax / top


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # Values across many binades, the subnormal range included, and exact zeros.
    t = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 4, shape, generator=g))
    t[0, : shape[1] // 4] = 0
    return t.to(DEVICE, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per", ["tensor", "row", "column"])
def test_a_cast_is_pytorchs_cast_of_the_same_scaled_values(dtype, per):
    t = _values((80, 144), 3)
    want, inverse = _reference_cast(t, dtype, per)
    cast, transposed, got_inverse = fp8.quantize(t, dtype, per, columns=True)
    # Equal values (a tiny negative may round to +0 where PyTorch gives -0).
    assert torch.equal(cast.float(), want.float())
    assert torch.equal(transposed.float(), want.float().t())
    torch.testing.assert_close(got_inverse.double(), inverse.double(), rtol=1e-6, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_a_cast_per_row_in_one_launch_is_pytorchs_cast_of_the_same_scaled_values(dtype, layout):
    """The rows-only cast per row (amax, scale and cast in one launch, a row wider than
    one block of columns) gives the two-pass cast's values and inverse scales, and with
    a column multiplier those of ``t diag(m)`` (rounded to fp32 first)."""
    t = _values((40, 600), 7)
    if layout == "column-major":
        t = t.t().contiguous().t()
    want, inverse = _reference_cast(t, dtype, "row")
    cast, transposed, got_inverse = fp8.quantize(t, dtype, "row")
    assert transposed is None and got_inverse.shape == (40, 1)
    assert torch.equal(cast.float(), want.float())
    torch.testing.assert_close(got_inverse.double(), inverse.double(), rtol=1e-6, atol=0)

    m = torch.rand(600, generator=torch.Generator().manual_seed(8)).to(DEVICE) + 0.5
    scaled = t.float() * m
    amax = scaled.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    top = torch.finfo(dtype).max
    want = (scaled * (torch.full_like(amax, top) / amax)).clamp(-top, top).to(dtype)
    cast, _, got_inverse = fp8.quantize(t, dtype, "row", multiplier=m)
    assert torch.equal(cast.float(), want.float())
    torch.testing.assert_close(got_inverse, amax / top, rtol=1e-6, atol=0)


@needs_triton
def test_a_strided_input_is_read_as_it_is_laid_out():
    t = _values((96, 64), 5).t()  # (64, 96), column-major
    want, _ = _reference_cast(t, fp8.E4M3, "tensor")
    cast, _, _ = fp8.quantize(t, fp8.E4M3, "tensor")
    assert torch.equal(cast.float(), want.float())


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_casts_and_a_transpose_launched_from_cpp_write_the_python_launches_bits(monkeypatch):
    """From a call signature's second call on, a cast per row (alone, with a column
    multiplier, with its amax in parts) and a transpose run by their launch plans, each
    call's own tensors: the bits the Python launches write."""
    from xpuruntime.pytorch._ops._infra import _native

    if _native.unavailable() is not None:
        pytest.skip(f"no launch plans here: {_native.unavailable()}")
    monkeypatch.setattr(fp8, "_plans", _native.PlanTable(fp8._plans._make))  # (its own)
    m = torch.rand(640, device="cuda") + 0.5
    for seed in range(3):  # (first call: Python; second: the plan derived; third: replayed)
        t = _values((48, 640), seed)
        parts = (t.float() * m).abs().view(48, 5, 128).amax(-1) * 1.5  # (a larger amax clamps)
        for multiplier, given in ((None, None), (m, None), (m, parts)):
            got = fp8.quantize(t, fp8.E4M3, "row", multiplier=multiplier, amax=given)
            want = fp8._rows_cast_launched(t, fp8.E4M3, multiplier, given)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
            assert torch.equal(got[2], want[2]) and got[2].shape == (48, 1)
        q = got[0]
        assert torch.equal(
            fp8.transposed(q).view(torch.uint8), q.t().contiguous().view(torch.uint8)
        )
    plans = list(fp8._plans._table.values())
    assert len(plans) == 4 and all(r.call is not _native._refuse for r in plans)
    assert not any(getattr(r.call, "__self__", None) is r for r in plans)  # all derived


def _emulated(a, b, dtype_a, dtype_b, per_a, per_b):
    """``a @ b.T`` in float64 from the operands quantized as the recipe quantizes them
    (per row of each: along the contraction)."""
    qa, sa = _reference_cast(a, dtype_a, per_a)
    qb, sb = _reference_cast(b, dtype_b, per_b)
    sb = sb if per_b == "tensor" else sb.reshape(1, -1)
    return (qa.double() @ qb.double().t()) * sa.double() * sb.double()


@needs_triton
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_layer_and_its_gradients_are_the_quantized_product(recipe):
    # Rowwise, the weight gradient's GEMM stays in bf16 (trained in e4m3, a model's loss
    # ended 3% above bf16's): its reference is the float64 product of the bf16 operands.
    x = (torch.randn(64, 96, device=DEVICE) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 96, device=DEVICE) / 10).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(64, 48, device=DEVICE).to(torch.bfloat16)
    y = fp8.fp8_linear(x, w, None, recipe)
    y.backward(dy)
    grad = fp8.E5M2 if recipe == "tensorwise" else fp8.E4M3
    per = "tensor" if recipe == "tensorwise" else "row"
    want_y = _emulated(x, w, fp8.E4M3, fp8.E4M3, per, per)
    want_dx = _emulated(dy, w.t(), grad, fp8.E4M3, per, per)
    if recipe == "tensorwise":
        want_dw = _emulated(dy.t(), x.detach().t(), grad, fp8.E4M3, per, per)
    else:
        want_dw = dy.double().t() @ x.detach().double()
    # On the CPU the products are summed in fp32 (exact here) and only the bf16 output
    # rounds; Hopper's FP8 tensor cores sum with fewer bits than fp32 (DeepSeek-V3's
    # report, arXiv:2412.19437, section 3.3.2), about 2^-9 of the largest output.
    spread = 2**-7 if DEVICE == "cuda" else 1e-6
    for got, want in ((y, want_y), (x.grad, want_dx), (w.grad, want_dw)):
        assert got.dtype == torch.bfloat16
        atol = spread * want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=atol)
    exact = x.detach().double() @ w.detach().double().t()
    assert (y.double() - exact).norm() / exact.norm() < 0.05  # FP8 is near, not exact


@needs_triton
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_a_joined_fp8_outputs_halves_are_taken_whole_by_a_gated_activation(recipe):
    """The FP8 GEMMs write a joined group's output as a tensor of the input's leading
    shape (not a view of a 2-D result), so that gate and up split from it are found as
    its halves: the SwiGLU takes them without copying each (and its gradient needs no
    cat). Both the LoRA op and the plain joined projections."""
    from xpuruntime.pytorch._functional._projections import joined_halves
    from xpuruntime.pytorch._ops.lora_linear import lora_projections
    from xpuruntime.pytorch._ops.projections import run_joined_fp8

    x = torch.randn(2, 16, 64, device=DEVICE, dtype=torch.bfloat16)
    weights = tuple(torch.randn(48, 64, device=DEVICE, dtype=torch.bfloat16) / 8 for _ in "ab")
    lora_as = tuple(torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16) for _ in "ab")
    lora_bs = tuple(torch.randn(48, 4, device=DEVICE, dtype=torch.bfloat16) for _ in "ab")
    lora = lora_projections(x, weights, (), lora_as, lora_bs, (1.0, 1.0), fp8=recipe)
    plain = run_joined_fp8(x, weights, (), recipe)
    for gate, up in (lora, plain):
        whole = joined_halves(gate, up)
        assert whole is not None and whole.shape == (2, 16, 96)


@needs_triton
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_a_joined_group_keeps_its_weights_not_their_cast_or_join(recipe):
    """A joined group's FP8 backward keeps the input's FP8 copy (tensorwise) or the
    input (rowwise) and the weights as given: no cast, join or FP8 copy of them (under
    FSDP2 the weights are the gathered ones, which it frees after the forward). Its
    gradients are those of the joined weight cast to bf16 by ``torch.cat``."""
    from kept_for_backward import kept_for_backward

    from xpuruntime.pytorch._ops.projections import run_joined_fp8

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 64, generator=g).to(DEVICE).requires_grad_()
    weights = [
        (torch.randn(n, 64, generator=g) / 8).to(DEVICE).requires_grad_() for n in (48, 16, 16)
    ]

    def run(joined):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return joined()

    kept = kept_for_backward(
        lambda: run(lambda: run_joined_fp8(x, tuple(weights), (), recipe)), weights
    )
    # tensorwise: x's FP8 copy and two fp32 scalars (its scale, the weights' amax);
    # rowwise: x in bf16
    assert kept == (x.numel() + 8 if recipe == "tensorwise" else 2 * x.numel())
    dy = torch.randn(2, 16, 80, generator=g).to(DEVICE, torch.bfloat16)
    outs = run(lambda: run_joined_fp8(x, tuple(weights), (), recipe))
    torch.cat(outs, -1).backward(dy)
    got = [w.grad.clone() for w in (x, *weights)]
    for w in (x, *weights):
        w.grad = None
    joined = torch.cat([w.to(torch.bfloat16) for w in weights])
    fp8.fp8_linear(x.to(torch.bfloat16), joined, None, recipe).backward(dy)
    for ours, want in zip(got, (x.grad, *(w.grad for w in weights))):
        assert ours.dtype == want.dtype == torch.float32
        assert torch.equal(ours, want)


@needs_triton
def test_a_bias_and_leading_dimensions_are_kept():
    x = torch.randn(2, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16) / 8
    b = torch.randn(32, device=DEVICE, dtype=torch.bfloat16)
    y = fp8.fp8_linear(x, w, b, "tensorwise")
    assert y.shape == (2, 32, 32)
    plain = fp8.fp8_linear(x, w, None, "tensorwise")
    torch.testing.assert_close(y, plain + b)


def test_what_fp8_gemms_do_not_take_is_said():
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedOperationError, match="divisible by 16 .*tokens 10"):
        fp8.fp8_linear(x, w, None, "tensorwise")
    with pytest.raises(UnsupportedOperationError, match="recipe 'blockwise'"):
        fp8.fp8_linear(x, w, None, "blockwise")


def test_the_policy_takes_saves_and_explains_fp8(tmp_path):
    for precision in ("fp8", "fp8_rowwise"):
        policy = KernelPolicy(precision=precision)
        policy.save(tmp_path / "p.json")
        assert KernelPolicy.load(tmp_path / "p.json") == policy
        assert f"precision={precision!r}" in repr(policy)
    with pytest.raises(Exception, match="precision"):
        KernelPolicy(precision="fp4")


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a device without FP8")
def test_a_device_without_fp8_runs_bf16_and_says_why_or_refuses_under_strict():
    model = _tiny_llama()
    report = xpt.optimize(model)
    ids = torch.randint(0, 96, (2, 16))
    try:
        with xpt.kernel_policy(precision="fp8", strict=True):
            with pytest.raises(BackendUnavailableError, match="precision='fp8': .*not the cpu"):
                model(ids, labels=ids)
        with xpt.kernel_policy(precision="fp8"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            explained = xpt.explain_kernel_policy()
        assert torch.isfinite(loss)
        assert "fused (auto): first supported candidate; supported; not fp8: FP8 GEMMs need" in (
            explained
        )
    finally:
        report.revert()


@needs_triton
def test_a_single_layer_runs_as_f_linear_under_autocast_would():
    x = torch.randn(2, 32, 64, device=DEVICE)  # fp32, as a residual stream holds it
    w = torch.randn(48, 64, device=DEVICE) / 8  # fp32 parameters
    b = torch.randn(48, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = fp8.run_linear(x, w, b, "tensorwise")
    want = fp8.fp8_linear(x.bfloat16(), w.bfloat16(), b.bfloat16(), "tensorwise")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def _one_wide_layer():
    """transformers, and a Llama of one layer at the 8B shape's width (every GEMM large
    enough for FP8); skips where the GPU has no FP8."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=256,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_optimized_llama_trains_in_fp8_near_bf16():
    transformers, config = _one_wide_layer()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 2048), device="cuda")
    loss_bf16 = model(ids, labels=ids).loss
    report = xpt.optimize(model, {"precision": "fp8"})
    try:
        loss = model(ids, labels=ids).loss
        loss.backward()
        decided = {
            op: {d.chosen for d in ROUTED_OPS[op].decisions.values()}
            for op in ("linear", "projections")
        }
        assert decided == {"linear": {"fp8"}, "projections": {"fp8"}}  # o, down; qkv, gate/up
        assert abs(loss.item() - loss_bf16.item()) < 0.02 * loss_bf16.item()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        report.revert()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_fp8_step_replays_the_fp8_gemms_and_trains_as_the_eager_step():
    # The FP8 path keeps its scales on the device (no host sync), so the whole step,
    # the amax reductions and casts included, is captured and replayed.
    transformers, config = _one_wide_layer()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (1, 2048), generator=g).cuda() for _ in range(4)]
    results = []
    for graph in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graph)
        step, report = xpt.make_train_step(
            model, lambda out, _: out.loss, opt, {"input_ids": batches[0], "labels": batches[0]},
            {"precision": "fp8", "cuda_graph": graph},
        )  # fmt: skip
        try:
            assert isinstance(step, xpt.GraphedTrainStep) == graph
            results.append([step({"input_ids": x, "labels": x}).item() for x in batches])
            decided = {d.chosen for op in ("linear", "projections")
                       for d in ROUTED_OPS[op].decisions.values()}  # fmt: skip
            assert decided == {"fp8"}
        finally:
            report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, rel=1e-2), (graphed, eager)
    assert graphed[-1] < graphed[0]


def test_under_fp8_the_swap_takes_single_layers_and_leaves_those_an_op_runs(monkeypatch):
    # Which linear layers FP8 reaches, decided at optimize time: on an FP8 GPU (said so
    # here, and every weight large enough) o and down become routed layers; q/k/v and
    # gate/up stay with the joined op, a fused LoRA layer's base with the LoRA op.
    from xpuruntime.pytorch._kernels import fp8 as fp8_kernels

    peft = pytest.importorskip("peft")
    monkeypatch.setattr(fp8_kernels, "fp8_refusal", lambda device: None)
    monkeypatch.setattr(fp8_kernels, "FP8_MIN_WEIGHT", 0)

    def swapped(model):
        report = xpt.optimize(model, {"precision": "fp8"})
        try:
            return sorted(path.rsplit(".", 1)[-1] for path, _, new in report.replaced
                          if new == "xpt.nn.Linear")  # fmt: skip
        finally:
            report.revert()

    assert swapped(_tiny_llama()) == ["down_proj", "o_proj"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules=targets))
    assert swapped(lora) == []


@needs_triton
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_a_lora_groups_base_gemms_are_the_quantized_product_and_its_adapters_bf16(recipe):
    """The LoRA op with ``fp8``: the frozen base's output and input-gradient GEMMs are the
    float64 product of the operands quantized as the recipe quantizes them; the adapters'
    terms and gradients are their float64 values from the bf16 operands; the base gets
    no gradient."""
    from xpuruntime.pytorch._ops.lora_linear import lora_projections

    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(DEVICE, torch.bfloat16)

    x = make(64, 96, scale=2.0).requires_grad_()
    weights = (make(32, 96, scale=0.1), make(16, 96, scale=0.1))  # q and k, say: frozen
    lora_as = tuple(make(4, 96, scale=0.1).requires_grad_() for _ in weights)
    lora_bs = tuple(make(n, 4, scale=0.1).requires_grad_() for n in (32, 16))
    dy = make(64, 48)
    q, k = lora_projections(x, weights, (), lora_as, lora_bs, (2.0, 2.0), fp8=recipe)
    torch.cat([q, k], -1).backward(dy)

    w = torch.cat(weights)
    grad = fp8.E5M2 if recipe == "tensorwise" else fp8.E4M3
    per = "tensor" if recipe == "tensorwise" else "row"
    xd, dyd = x.detach().double(), dy.double()
    a, b = torch.cat(lora_as).detach().double(), torch.block_diag(*lora_bs).detach().double()
    t = 2.0 * xd @ a.t()
    want_y = _emulated(x.detach(), w, fp8.E4M3, fp8.E4M3, per, per) + t @ b.t()
    ds = 2.0 * dyd @ b
    want_dx = _emulated(dy, w.t(), grad, fp8.E4M3, per, per) + ds @ a
    blocks = torch.block_diag(*(torch.ones_like(p, dtype=torch.float64) for p in lora_bs))
    want_da, want_db = ds.t() @ xd, (dyd.t() @ t) * blocks
    spread = 2**-7 if DEVICE == "cuda" else 2**-8  # (bf16 terms summed in bf16 on the CPU)
    got_db = torch.block_diag(*(p.grad for p in lora_bs))
    for got, want in ((torch.cat([q, k], -1), want_y), (x.grad, want_dx),
                      (torch.cat([p.grad for p in lora_as]), want_da), (got_db, want_db)):  # fmt: skip
        torch.testing.assert_close(
            got.double(), want, rtol=2**-7, atol=spread * want.abs().max().item()
        )
    assert all(w.grad is None for w in weights)


def test_the_lora_ops_fp8_kernels_say_what_they_do_not_take():
    from xpuruntime.pytorch._ops.lora_linear import lora_projections

    x = torch.randn(10, 64, dtype=torch.bfloat16)
    w, a, b = torch.randn(32, 64), torch.randn(4, 64), torch.randn(32, 4)
    args = (x, (w.bfloat16(),), (), (a,), (b,), (1.0,))
    with pytest.raises(UnsupportedOperationError, match="divisible by 16 .*tokens 10"):
        lora_projections(*args, fp8="tensorwise")
    with pytest.raises(UnsupportedOperationError, match="recipe 'blockwise'"):
        lora_projections(*args, fp8="blockwise")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peft_lora_llama_runs_its_base_gemms_in_fp8_and_trains_near_bf16():
    """Under ``precision='fp8'`` a peft LoRA model's fused groups (q/k/v, o, gate/up,
    down) run the fp8 kernel of ``lora_linear``; the loss is near the bf16 one and the
    adapters' gradients near bf16's."""
    from peft import LoraConfig, get_peft_model

    transformers, config = _one_wide_layer()
    grads, losses = {}, {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        ids = torch.randint(0, 256, (1, 2048), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
        report = xpt.optimize(model, {"precision": precision})
        try:
            # peft keeps the adapters in fp32: under autocast, as they are trained
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if precision == "fp8":
                decided = ROUTED_OPS["lora_linear"].decisions.values()
                assert {d.chosen for d in decided} == {"fp8"}, [d.rejected for d in decided]
        finally:
            report.revert()
        losses[precision] = loss.item()
        grads[precision] = torch.cat(
            [p.grad.flatten().float() for n, p in model.named_parameters() if "lora_A" in n]
        )
    assert abs(losses["fp8"] - losses["bf16"]) < 0.02 * losses["bf16"]
    cosine = torch.nn.functional.cosine_similarity(grads["fp8"], grads["bf16"], dim=0)
    assert cosine > 0.95


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a device without FP8")
def test_a_peft_model_under_fp8_on_a_device_without_it_runs_its_lora_groups_fused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules="all-linear"))
    report = xpt.optimize(model, {"precision": "fp8"})
    ids = torch.randint(0, 96, (2, 16))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        decisions = ROUTED_OPS["lora_linear"].decisions.values()
        assert {d.chosen for d in decisions} == {"fused"}
        assert all("not fp8: FP8 GEMMs need" in d.reason for d in decisions)
    finally:
        report.revert()

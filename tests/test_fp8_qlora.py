"""QLoRA's 4-bit base under ``precision="fp8"``: a group of bitsandbytes 4-bit weights
made e4m3 by rows in one Triton pass (each row's scale its blocks' largest, the values
the e4m3 cast of bitsandbytes' own dense weight, in the layout each GEMM reads), the
LoRA op's GEMMs over them the float64 product of the same quantized operands, and
``optimize`` running a peft QLoRA Llama so, near its bf16 run. What the pass cannot take
is said. The FP8 GEMMs run on the CPU here (PyTorch's ``_scaled_mm``), the casts under
Triton's interpreter; on an FP8 GPU the same tests run compiled."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("triton")

from bitsandbytes import functional as bnb_functional  # noqa: E402
from fp8_reference import emulated_rows, lora_step  # noqa: E402
from tiny_configs import SMALL  # noqa: E402

from xpuruntime import UnsupportedOperationError  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops import fp8, nf4  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import triton_unavailable  # noqa: E402
from xpuruntime.pytorch._selection._routed import ROUTED_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable(torch.device(DEVICE)) is not None
    or (DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9)),
    reason="FP8 GEMMs or Triton do not run here",
)


def _four_bit(rows: int, width: int, quant_type="nf4", nested=False, seed=0):
    """A frozen bitsandbytes 4-bit weight (``Params4bit``, quantized) of random values."""
    g = torch.Generator().manual_seed(seed)
    layer = bnb.nn.Linear4bit(width, rows, bias=False, compute_dtype=torch.bfloat16,
                              quant_type=quant_type, compress_statistics=nested)  # fmt: skip
    layer.weight = bnb.nn.Params4bit(
        torch.randn(rows, width, generator=g) * 0.1, requires_grad=False,
        quant_type=quant_type, compress_statistics=nested,
    )  # fmt: skip
    return layer.to(DEVICE).weight


def _dense(weights) -> torch.Tensor:
    """bitsandbytes' own dense weights of a group, joined by rows, in fp32."""
    parts = [bnb_functional.dequantize_4bit(w.data, w.quant_state) for w in weights]
    return torch.cat(parts).float()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain-scales", "double-quantized"])
def test_a_4bit_group_made_fp8_is_the_e4m3_cast_of_bitsandbytes_weight_by_rows(quant_type, nested):
    # Rows of 192: flat blocks of 1024 elements straddle rows.
    weights = tuple(_four_bit(rows, 192, quant_type, nested, seed=rows) for rows in (96, 32, 64))
    assert nf4.fp8_4bit_unsupported(weights) is None
    values, scale = nf4.fp8_4bit(weights)
    columns, same = nf4.fp8_4bit(weights, columns=True)
    dense = _dense(weights)
    amax = dense.abs().amax(1)
    # Each row's scale is its amax over e4m3's largest value: a block's largest
    # magnitude is stored as the code table's largest.
    assert same is scale and torch.equal(scale, amax / 448)
    want = (dense * (448 / amax)[:, None]).clamp(-448, 448).to(fp8.E4M3)
    assert values.shape == dense.shape and columns.shape == dense.t().shape
    if DEVICE == "cuda":
        # (the GPU may fuse a double-quantized scale's multiply and add, and round a
        # product bitsandbytes' kernel rounds apart: a tie then goes one e4m3 step over)
        for got in (values, columns.t()):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-3, atol=0)
    else:  # equal values (bitsandbytes 0.50 writes fp4's code 8 as -0.0, its table +0.0)
        assert torch.equal(values.float(), want.float())
        assert torch.equal(columns.t().float(), want.float())


def test_what_a_4bit_group_cannot_be_made_fp8_is_said():
    straddling = (_four_bit(32, 96),)  # rows of 96: bitsandbytes' blocks of 64 straddle them
    assert "whole number of bitsandbytes' blocks" in nf4.fp8_4bit_unsupported(straddling)
    with pytest.raises(UnsupportedOperationError, match="blocks of 64"):
        nf4.fp8_4bit(straddling)
    dense = (torch.nn.Parameter(torch.zeros(32, 64, device=DEVICE), requires_grad=False),)
    assert "bitsandbytes 4-bit weights" in nf4.fp8_4bit_unsupported(dense)


def test_a_qlora_groups_gemms_over_fp8_rows_are_the_quantized_product():
    """The LoRA op over a 4-bit group with ``fp8``: ``q(x) W8^T`` forward (x per token,
    W8 the rows' e4m3 values and scales) and ``q(dY diag(s)) W8/s`` for the input
    gradient, each against float64; the adapters' terms in bf16 as over any base."""
    from xpuruntime.pytorch._ops.lora_linear import lora_projections

    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(DEVICE, torch.bfloat16)

    weights = (_four_bit(64, 128, seed=1), _four_bit(32, 128, seed=2))
    values, scale = nf4.fp8_4bit(weights)
    w8 = values.double() * scale.double()[:, None]
    x = make(48, 128, scale=2.0).requires_grad_()
    lora_as = tuple(make(4, 128, scale=0.1).requires_grad_() for _ in weights)
    lora_bs = tuple(make(n, 4, scale=0.1).requires_grad_() for n in (64, 32))
    dy = make(48, 96)
    q, k = lora_projections(x, weights, (), lora_as, lora_bs, (2.0, 2.0),
                            torch.bfloat16, fp8="tensorwise")  # fmt: skip
    torch.cat([q, k], -1).backward(dy)
    a, b = torch.cat(lora_as).detach().double(), torch.block_diag(*lora_bs).detach().double()
    xd, dyd = x.detach().double(), dy.double()
    want_y = emulated_rows(x.detach().float(), w8.t()) + 2.0 * (xd @ a.t()) @ b.t()
    folded = dy.float() * scale  # dY diag(s), in fp32 as the cast computes it
    want_dx = emulated_rows(folded, values.double()) + 2.0 * (dyd @ b) @ a
    spread = 2**-7 if DEVICE == "cuda" else 2**-8
    for got, want in ((torch.cat([q, k], -1), want_y), (x.grad, want_dx)):
        torch.testing.assert_close(got.double(), want, rtol=2**-7,
                                   atol=spread * want.abs().max().item())  # fmt: skip
    assert all(p.grad is not None for p in (*lora_as, *lora_bs))


def _qlora_model(model_type: str = "llama", targets="all-linear"):
    """A tiny Llama (or another family's model) whose decoder linear layers are
    bitsandbytes' nf4 Linear4bit (bf16 compute), with peft's LoRA on all of them (or on
    ``targets``; B nonzero, as trained adapters)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    wide = {**SMALL, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
    config = transformers.AutoConfig.for_model(model_type, **wide)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name.endswith("_proj"):
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                              bias=False, compute_dtype=torch.bfloat16,
                                              quant_type="nf4")  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(
                    child.weight.data.float(), requires_grad=False, quant_type="nf4"
                )
                setattr(module, name, quantized)
    model = model.to(DEVICE)
    model.is_loaded_in_4bit = True  # what peft reads to wrap the layers as QLoRA's
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [("llama", "all-linear"), ("qwen3", "all-linear"), ("gemma3_text", "all-linear"),
     ("llama", ("q_proj", "v_proj"))],
    ids=["llama", "qwen3", "gemma3_text", "llama-peft-default-targets"],
)  # fmt: skip
def test_optimize_runs_a_qlora_model_with_fp8_gemms_near_its_bf16_run(
    model_type, targets, any_shape_pays
):
    """transformers' Llama, Qwen3 (norms on q and k) and Gemma3 (its own norms and
    scaled embeddings), their decoder layers in nf4 under peft: every LoRA group runs
    FP8 over its 4-bit base, near the bf16 run; with peft's default targets the 4-bit
    layers without an adapter too."""
    model = _qlora_model(model_type, list(targets) if isinstance(targets, tuple) else targets)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    report = xpt.optimize(model)
    want_loss, want_grads = lora_step(model, ids)
    report.revert()
    report = xpt.optimize(model, {"precision": "fp8"})
    try:
        loss, grads = lora_step(model, ids)
        decided = ROUTED_OPS["lora_linear"].decisions.values()
        assert {d.chosen for d in decided} == {"fp8"}, [d.rejected for d in decided]
    finally:
        report.revert()
    assert abs(loss - want_loss) < 0.02 * want_loss
    assert torch.nn.functional.cosine_similarity(grads, want_grads, dim=0) > 0.95


@pytest.mark.parametrize("bound", ["tokens", "weight"])
def test_below_the_tables_bounds_a_qlora_layer_stays_bf16_with_the_reason(
    bound, fp8_here, monkeypatch
):
    """A 4-bit base pays by the stated table as any base does. Each call adds casts and
    launches that a small layer's faster GEMM does not repay: on an H200, Qwen3-1.7B's
    host-bound QLoRA step went 164.6 -> 185.6 ms with every layer in FP8."""
    from xpuruntime.pytorch._kernels import fp8 as fp8_kernels

    other = "FP8_MIN_WEIGHT" if bound == "tokens" else "FP8_MIN_TOKENS"
    monkeypatch.setattr(fp8_kernels, other, 0)  # (only the bound tested holds)
    model = _qlora_model()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    report = xpt.optimize(model, {"precision": "fp8"})
    try:
        lora_step(model, ids)
        decided = list(ROUTED_OPS["lora_linear"].decisions.values())
        assert decided and all(d.chosen != "fp8" for d in decided)
        assert all("FP8 does not pay below" in str(d.rejected) for d in decided)
    finally:
        report.revert()


def test_a_qlora_model_under_fp8_saved_whole_loads_and_trains_as_before(any_shape_pays):
    """torch.save(model) of an optimized QLoRA model under FP8: the loaded model runs
    peft's own QLoRA forward (bf16, near), and optimized again its FP8 groups give the
    same loss and gradients to the bit (the 4-bit bytes and their scales unchanged)."""
    model = _qlora_model()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    xpt.optimize(model, {"precision": "fp8"})
    want_loss, want_grads = lora_step(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loss, grads = lora_step(loaded, ids)
    assert abs(loss - want_loss) < 0.02 * want_loss
    assert torch.nn.functional.cosine_similarity(grads, want_grads, dim=0) > 0.95
    xpt.optimize(loaded, {"precision": "fp8"})
    loss, grads = lora_step(loaded, ids)
    assert {d.chosen for d in ROUTED_OPS["lora_linear"].decisions.values()} == {"fp8"}
    assert loss == want_loss and torch.equal(grads, want_grads)


@pytest.fixture
def any_shape_pays(fp8_here, monkeypatch):
    """FP8 taken at a test's shapes (the table's bounds, 2048 tokens and a 4096 x 4096
    weight, are above them)."""
    from xpuruntime.pytorch._kernels import fp8 as fp8_kernels

    monkeypatch.setattr(fp8_kernels, "FP8_MIN_TOKENS", 16)
    monkeypatch.setattr(fp8_kernels, "FP8_MIN_WEIGHT", 0)


def test_a_checkpointed_qlora_step_under_fp8_is_the_plain_ones(any_shape_pays):
    """transformers' gradient checkpointing runs each layer's forward again in the
    backward, making the 4-bit base FP8 again: the same bits, so the same loss and
    adapter gradients as without it."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = []
    for checkpointing in (False, True):
        model = _qlora_model()
        if checkpointing:
            model.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
            model.enable_input_require_grads()
        report = xpt.optimize(model, {"precision": "fp8"})
        try:
            results.append(lora_step(model, ids))
            decided = ROUTED_OPS["lora_linear"].decisions.values()
            assert {d.chosen for d in decided} == {"fp8"}
        finally:
            report.revert()
    (want_loss, want_grads), (loss, grads) = results
    assert loss == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(grads, want_grads, rtol=1e-4, atol=1e-6)


def test_under_torch_compile_a_qlora_layer_runs_its_bf16_kernel(any_shape_pays):
    """Compiled, the LoRA layers run their bf16 kernel inside the graph (as policy.md
    says of FP8 under compile), the 4-bit base made dense by bitsandbytes' registered
    op: the step is the eager bf16 QLoRA step's."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = []
    for precision, compiled in (("bf16", False), ("fp8", True)):
        model = _qlora_model()
        report = xpt.optimize(model, {"precision": precision})
        try:
            run = torch.compile(model, backend="aot_eager") if compiled else model
            results.append(lora_step(run, ids))
        finally:
            report.revert()
            torch._dynamo.reset()
    (want_loss, want_grads), (loss, grads) = results
    assert loss == pytest.approx(want_loss, rel=1e-4)
    # (bf16 roundings of a traced graph's own order: no FP8's, which would move them more)
    assert torch.nn.functional.cosine_similarity(grads, want_grads, dim=0) > 0.9999


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a CUDA GPU")
def test_a_graphed_qlora_step_under_fp8_replays_as_the_eager_step(any_shape_pays):
    """``make_train_step(..., cuda_graph=True)`` over a 4-bit base under FP8: the pass
    that makes it FP8 (its scales found before the capture), the casts and the GEMMs are
    captured and replayed, and the step trains as the eager one."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    batch = {"input_ids": ids, "labels": ids}
    results = []
    for graph in (False, True):
        model = _qlora_model()
        adapters = [p for n, p in model.named_parameters() if "lora_" in n]
        optimizer = torch.optim.AdamW(adapters, lr=1e-2, fused=True, capturable=graph)
        policy = {"precision": "fp8", "cuda_graph": graph}
        step, report = xpt.make_train_step(model, lambda out, _: out.loss, optimizer, batch,
                                           policy)  # fmt: skip
        try:
            assert isinstance(step, xpt.GraphedTrainStep) == graph
            results.append([step(batch).item() for _ in range(4)])
            decided = ROUTED_OPS["lora_linear"].decisions.values()
            assert {d.chosen for d in decided} == {"fp8"}
        finally:
            report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, rel=1e-2), (graphed, eager)
    assert graphed[-1] < graphed[0]


def test_two_threads_making_new_groups_fp8_at_once_get_each_ones_own_values():
    """Two threads each make a group FP8 for the first time at once (its scales found,
    its launch arguments made and kept): each gets its own group's values, as one
    thread alone does."""
    from at_once import at_once

    groups = [(_four_bit(64, 128, seed=10 + k), _four_bit(32, 128, seed=20 + k)) for k in (0, 1)]
    dense = [_dense(g) for g in groups]
    want = [(d * (448 / d.abs().amax(1))[:, None]).clamp(-448, 448).to(fp8.E4M3) for d in dense]
    got: dict[int, tuple] = {}

    def make(k: int) -> None:
        got[k] = (nf4.fp8_4bit(groups[k]), nf4.fp8_4bit(groups[k], columns=True))

    at_once(make, 2, timeout=300)
    assert sorted(got) == [0, 1]  # (a thread that raised put nothing)
    for k, ((values, scale), (columns, same)) in got.items():
        assert same is scale
        if DEVICE == "cuda":  # (one e4m3 step where a product rounds otherwise: above)
            for made in (values, columns.t()):
                torch.testing.assert_close(made.float(), want[k].float(), rtol=2**-3, atol=0)
        else:
            assert torch.equal(values.view(torch.uint8), want[k].view(torch.uint8))
            assert torch.equal(columns.t().view(torch.uint8), want[k].view(torch.uint8))

"""A frozen LoRA base stored once in FP8 (issue 67, the policy's ``fp8_base``): the
stored weight reads as its rounded values wherever it is used (peft's own forward,
``state_dict``, ``torch.save``, in-place writes), the LoRA op's GEMMs over it are the
float64 product of the same quantized operands, ``optimize`` stores a peft Llama's bases
(a joined group as one tensor) and trains it near the bf16 model, and what cannot be
stored is refused with the reason. The FP8 GEMMs run on the CPU here (PyTorch's
``_scaled_mm``), their casts under Triton's interpreter; on an FP8 GPU the same tests
run compiled."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fp8_reference import emulated_rows, lora_step  # noqa: E402
from tiny_configs import SMALL  # noqa: E402

from xpuruntime import BackendUnavailableError, PolicyError, UnsupportedOperationError  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.policies import KernelPolicy  # noqa: E402
from xpuruntime.pytorch._ops import fp8  # noqa: E402
from xpuruntime.pytorch._ops._infra._fp8_weight import Fp8Weight, store_fp8  # noqa: E402
from xpuruntime.pytorch._ops._infra._joined_storage import store_joined  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import triton_unavailable  # noqa: E402
from xpuruntime.pytorch._selection._routed import ROUTED_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_fp8 = pytest.mark.skipif(
    triton_unavailable(torch.device(DEVICE)) is not None
    or (DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9)),
    reason="FP8 GEMMs or Triton do not run here",
)


def _frozen(*shape, scale=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=g) * scale).to(DEVICE, torch.bfloat16)
    return torch.nn.Parameter(values, requires_grad=False)


def _rows_reference(w: torch.Tensor) -> torch.Tensor:
    """``w`` quantized to e4m3 with one scale per row (each row's amax at 448; the
    division in fp32, rounded once to e4m3 by PyTorch's cast), in float64."""
    w = w.detach().float()
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    return (w / scale).clamp(-448, 448).to(fp8.E4M3).double() * scale.double()


def test_a_stored_weight_reads_as_its_rounded_values_wherever_it_is_used():
    layer = torch.nn.Linear(64, 32, bias=False, device=DEVICE, dtype=torch.bfloat16)
    layer.requires_grad_(False)
    written = layer.weight.detach().clone()
    (layer.weight,) = store_fp8([layer.weight])
    rounded = layer.weight.dequantize()
    assert isinstance(layer.weight, Fp8Weight) and isinstance(layer.weight, torch.nn.Parameter)
    assert layer.weight.dtype == torch.bfloat16 and not layer.weight.requires_grad
    assert layer.weight.qdata.dtype == fp8.E4M3 and layer.weight.qdata.element_size() == 1
    torch.testing.assert_close(rounded.double(), _rows_reference(written), rtol=2**-8, atol=0)
    # The layer's own forward (peft's, where the op does not run) reads the rounded values.
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, rounded))
    # Saved and loaded whole: the rounded values, as a plain parameter.
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.weight) is torch.nn.Parameter and not loaded.weight.requires_grad
    assert torch.equal(loaded.weight.data, rounded)
    # Moved and copied, it stays FP8.
    moved = copy.deepcopy(layer).to("meta")
    assert type(moved.weight) is Fp8Weight and moved.weight.qdata.is_meta
    copied = copy.deepcopy(layer)
    assert type(copied.weight) is Fp8Weight and torch.equal(copied.weight.dequantize(), rounded)
    assert copied.weight.qdata.data_ptr() != layer.weight.qdata.data_ptr()
    plain = torch.nn.Linear(64, 32, bias=False, device=DEVICE, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    assert type(plain.weight) is torch.nn.Parameter and torch.equal(plain.weight.data, rounded)
    # Written whole (load_state_dict's copy_): quantized into the stored bytes.
    layer.load_state_dict({"weight": written * 2})
    torch.testing.assert_close(layer.weight.dequantize().double(), _rows_reference(written * 2),
                               rtol=2**-8, atol=0)  # fmt: skip
    # Any other write in place (a merge's add_) is refused, the bytes as they were: its
    # result rounded to e4m3 again would lose a small update.
    before = layer.weight.qdata.clone(), layer.weight.scale.clone()
    for write in (lambda w: w.add_(1e-3), lambda w: w.data.mul_(2.0)):
        with torch.no_grad(), pytest.raises(UnsupportedOperationError, match="add_|mul_") as e:
            write(layer.weight)
        assert "revert()" in str(e.value) and "fp8_base" in str(e.value)
    assert type(layer.weight) is Fp8Weight
    assert torch.equal(layer.weight.qdata, before[0]) and torch.equal(layer.weight.scale, before[1])


def test_a_saved_state_dict_loads_without_this_package_under_weights_only(tmp_path):
    """``torch.save(model.state_dict())`` of a model with stored bases writes their
    rounded values as plain tensors: ``torch.load`` reads it with its default
    ``weights_only=True`` in a process that never imports xpuruntime, and the values load
    into a plain layer and back into a stored one (quantized again to the same bytes)."""
    import subprocess
    import sys

    layer = torch.nn.Linear(64, 32, bias=True, device=DEVICE, dtype=torch.bfloat16)
    layer.requires_grad_(False)
    (layer.weight,) = store_fp8([layer.weight])
    rounded, qdata = layer.weight.dequantize(), layer.weight.qdata.clone()
    path = tmp_path / "state.pt"
    torch.save(layer.state_dict(), path)
    code = (
        "import sys, torch; state = torch.load(sys.argv[1], map_location='cpu'); "
        "w = state['weight']; assert type(w) is torch.Tensor and w.dtype == torch.bfloat16, "
        "type(w); assert 'xpuruntime' not in sys.modules; print(w.float().sum().item())"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) == rounded.float().sum().item()
    state = torch.load(path)
    assert torch.equal(state["weight"], rounded) and torch.equal(state["bias"], layer.bias)
    plain = torch.nn.Linear(64, 32, device=DEVICE, dtype=torch.bfloat16)
    plain.load_state_dict(state)
    assert torch.equal(plain.weight.data, rounded)
    layer.load_state_dict(state)  # (its own values again: the same e4m3 bytes)
    assert type(layer.weight) is Fp8Weight and torch.equal(layer.weight.qdata, qdata)


def test_a_stored_weight_cut_and_padded_by_rows_as_fsdp2_shards_it_keeps_its_bytes():
    """The ops FSDP2 shards a parameter with (torch.chunk, new_zeros, narrow, copy_, a
    flat view, as_strided) keep a stored weight FP8: whole rows with their scales, the
    bytes copied exactly; its gather hooks give back the weight over gathered bytes."""
    layer = torch.nn.Linear(64, 32, bias=False, device=DEVICE, dtype=torch.bfloat16)
    (weight,) = store_fp8([layer.weight.requires_grad_(False)])
    rounded = weight.dequantize()
    first, second = torch.chunk(weight, 2, dim=0)
    assert type(second) is Fp8Weight and torch.equal(second.dequantize(), rounded[16:])
    padded = second.new_zeros((20, 64))
    assert type(padded) is Fp8Weight and padded.qdata.dtype == fp8.E4M3
    padded.narrow(0, 0, 16).copy_(second)
    assert torch.equal(padded.qdata[:16].view(torch.uint8), second.qdata.view(torch.uint8))
    assert torch.equal(padded.dequantize()[:16], rounded[16:])
    flat = padded.view(-1)
    assert type(flat) is Fp8Weight and flat.shape == (20 * 64,)
    assert torch.equal(flat.dequantize(), padded.dequantize().view(-1))
    assert type(torch.as_strided(first, (16, 64), (64, 1), 0)) is Fp8Weight
    # FSDP2's extension: a shard gathers its bytes and scales, seen without a copy as the
    # dtype the block's other parameters gather in (one flat buffer of it, not every
    # input viewed as bytes); the gathered weight reads them (a later gather into the
    # same tensors needs nothing made).
    (qdata, scale), _ = first.fsdp_pre_all_gather(None, weight.shape, (64, 1), None, None)
    assert qdata.dtype == scale.dtype == torch.bfloat16
    assert (qdata.data_ptr(), scale.data_ptr()) == (first.qdata.data_ptr(), first.scale.data_ptr())
    (qdata2, scale2), _ = second.fsdp_pre_all_gather(None, weight.shape, (64, 1), None, None)
    gathered = torch.cat([qdata, qdata2]), torch.cat([scale, scale2])
    whole, inner = first.fsdp_post_all_gather(gathered, None, torch.bfloat16)
    assert type(whole) is Fp8Weight and torch.equal(whole.dequantize(), rounded)
    assert inner[0].dtype == fp8.E4M3 and inner[0].data_ptr() == gathered[0].data_ptr()
    assert first.fsdp_post_all_gather(gathered, None, torch.bfloat16, out=whole) is None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32)
    (qdata, scale), _ = first.fsdp_pre_all_gather(None, weight.shape, (64, 1), None, fp32)
    assert qdata.dtype == scale.dtype == torch.float32 and qdata.shape == (16, 16)
    (qdata2, scale2), _ = second.fsdp_pre_all_gather(None, weight.shape, (64, 1), None, fp32)
    gathered = torch.cat([qdata, qdata2]), torch.cat([scale, scale2])
    whole, _ = first.fsdp_post_all_gather(gathered, None, torch.bfloat16)
    assert torch.equal(whole.dequantize(), rounded)
    rows_of_63 = torch.randn(4, 63, device=DEVICE, dtype=torch.bfloat16)
    (odd,) = store_fp8([torch.nn.Parameter(rows_of_63, requires_grad=False)])
    (qdata, scale), _ = odd.fsdp_pre_all_gather(None, odd.shape, (63, 1), None, None)
    assert qdata.dtype == fp8.E4M3  # rows of 63 bytes are no whole bf16s: kept as bytes
    # Anything else on the rows (a strided slice, a split along columns) is dense.
    assert type(weight[::2]) is torch.Tensor and torch.equal(weight[::2], rounded[::2])
    assert type(torch.chunk(weight, 2, dim=1)[0]) is torch.Tensor


def test_a_joined_group_is_stored_as_one_tensor_and_read_without_a_copy():
    from xpuruntime.pytorch._ops._infra._fp8_weight import fp8_joined

    weights = [_frozen(32, 64, seed=1), _frozen(16, 64, seed=2), _frozen(16, 64, seed=3)]
    assert store_joined(weights)
    stored = store_fp8(weights)
    qdata, scale = fp8_joined(tuple(stored))
    assert qdata.shape == (64, 64) and scale.shape == (64,)
    assert qdata.data_ptr() == stored[0].qdata.data_ptr()  # a view: no copy
    for part, weight in zip(stored, weights):
        assert torch.equal(
            part.dequantize().double(), _rows_reference(weight).to(torch.bfloat16).double()
        )


@needs_fp8
def test_a_stored_lora_groups_gemms_are_the_quantized_product_and_its_adapters_bf16():
    """Over a stored base the LoRA op's forward is ``q(x) W_q^T`` (x per token, W as
    stored) and its input gradient ``q(dY diag(s)) qdata``, each against float64; the
    adapters' terms as over a bf16 base. Either recipe reads the stored base so."""
    from xpuruntime.pytorch._ops.lora_linear import lora_projections

    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(DEVICE, torch.bfloat16)

    weights = [_frozen(32, 96, seed=4), _frozen(16, 96, seed=5)]
    store_joined(weights)
    stored = tuple(store_fp8(weights))
    w = torch.cat([s.dequantize(torch.float64) for s in stored])
    scale = torch.cat([s.scale for s in stored]).double()
    for recipe in fp8.RECIPES:
        x = make(64, 96, scale=2.0).requires_grad_()
        lora_as = tuple(make(4, 96, scale=0.1).requires_grad_() for _ in stored)
        lora_bs = tuple(make(n, 4, scale=0.1).requires_grad_() for n in (32, 16))
        dy = make(64, 48)
        q, k = lora_projections(x, stored, (), lora_as, lora_bs, (2.0, 2.0), fp8=recipe)
        torch.cat([q, k], -1).backward(dy)
        a, b = torch.cat(lora_as).detach().double(), torch.block_diag(*lora_bs).detach().double()
        xd, dyd = x.detach().double(), dy.double()
        want_y = emulated_rows(x.detach().float(), w.t()) + 2.0 * (xd @ a.t()) @ b.t()
        folded = dy.float() * scale.float()  # dY diag(s), in fp32 as the cast computes it
        want_dx = emulated_rows(folded, w / scale[:, None]) + 2.0 * (dyd @ b) @ a
        spread = 2**-7 if DEVICE == "cuda" else 2**-8
        for got, want in ((torch.cat([q, k], -1), want_y), (x.grad, want_dx)):
            torch.testing.assert_close(got.double(), want, rtol=2**-7,
                                       atol=spread * want.abs().max().item())  # fmt: skip
        assert all(p.grad is not None for p in (*lora_as, *lora_bs))


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)


def _peft_llama():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


@needs_fp8
def test_optimize_stores_a_peft_llamas_bases_in_fp8_and_it_trains_near_bf16(fp8_here):
    model = _peft_llama()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_loss, want_grads = lora_step(model, ids)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if "base_layer" in n)  # fmt: skip
    attention = "base_model.model.model.layers.0.self_attn"
    written = weakref.ref(model.get_parameter(f"{attention}.q_proj.base_layer.weight"))
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        assert len(report.fp8_bases) == 14, str(report)  # 7 a layer
        gc.collect()
        assert written() is None  # the bf16 weight is freed, not kept beside its FP8 copy
        bases = {n: p for n, p in model.named_parameters() if "base_layer.weight" in n}
        assert all(type(p) is Fp8Weight for p in bases.values())
        stored_bytes = sum(p.qdata.numel() + 4 * p.scale.numel() for p in bases.values())
        assert stored_bytes < 0.6 * base_bytes
        # q/k/v of a layer lie in one FP8 tensor, as their bf16 weights lay joined.
        qkv = [bases[f"{attention}.{n}_proj.base_layer.weight"].qdata for n in "qkv"]
        assert qkv[1].data_ptr() == qkv[0].data_ptr() + qkv[0].numel()
        loss, grads = lora_step(model, ids)
        # fp8 at 32 tokens, far below the table's bound: a stored base has nothing to cast.
        decided = ROUTED_OPS["lora_linear"].decisions.values()
        assert {d.chosen for d in decided} == {"fp8"}, [d.rejected for d in decided]
    finally:
        report.revert()
    assert abs(loss - want_loss) < 0.02 * want_loss
    assert torch.nn.functional.cosine_similarity(grads, want_grads, dim=0) > 0.95
    # Reverted: dense weights again, of the stored (rounded) values.
    after = [p for n, p in model.named_parameters() if "base_layer.weight" in n]
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in after)


@needs_fp8
def test_with_peft_default_targets_k_is_stored_with_q_and_v_and_read_joined(fp8_here):
    """peft's default targets adapt q_proj and v_proj alone; k joins them in one node,
    so ``fp8_base`` stores it with them in one FP8 tensor (the MLP, no LoRA layer's
    base, keeps its weights). The step stays near the bf16 one."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_loss, want_grads = lora_step(model, ids)
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        stored = {path.rsplit(".", 1)[-1] for path in report.fp8_bases}
        assert len(report.fp8_bases) == 6 and stored == {"q_proj", "k_proj", "v_proj"}, str(report)
        attention = model.base_model.model.model.layers[0].self_attn
        q, k = attention.q_proj.base_layer.weight, attention.k_proj.weight
        assert type(k) is Fp8Weight and k.qdata.data_ptr() == q.qdata.data_ptr() + q.qdata.numel()
        assert type(model.base_model.model.model.layers[0].mlp.up_proj.weight) is not Fp8Weight
        loss, grads = lora_step(model, ids)
    finally:
        report.revert()
    assert abs(loss - want_loss) < 0.02 * want_loss
    assert torch.nn.functional.cosine_similarity(grads, want_grads, dim=0) > 0.95


@needs_fp8
def test_a_compiled_model_over_stored_bases_trains_as_the_eager_one(fp8_here):
    """``torch.compile`` after ``optimize`` with ``fp8_base``: the stored weights trace
    (a joined group's bytes are joined by a cat inside the graph) and the step computes
    what the eager one does."""
    model = _peft_llama()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        eager_loss, eager_grads = lora_step(model, ids)
        loss, grads = lora_step(torch.compile(model), ids)
    finally:
        report.revert()
        torch._dynamo.reset()
    assert abs(loss - eager_loss) < 1e-3 * eager_loss
    assert torch.nn.functional.cosine_similarity(grads, eager_grads, dim=0) > 0.99


@needs_fp8
def test_stored_bases_train_the_same_checkpointed_and_by_a_train_step(fp8_here):
    """Over stored bases, transformers' gradient checkpointing (the layers' forwards run
    again in the backward, over the same FP8 bytes) and ``make_train_step`` give the
    plain optimized model's loss and adapter gradients."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    policy = {"precision": "fp8", "fp8_base": True}
    model = _peft_llama()
    report = xpt.optimize(model, policy)
    try:
        want_loss, want_grads = lora_step(model, ids)
    finally:
        report.revert()
    checkpointed = _peft_llama()
    checkpointed.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
    checkpointed.train()
    report = xpt.optimize(checkpointed, policy)
    try:
        assert len(report.fp8_bases) == 14
        loss, grads = lora_step(checkpointed, ids)
    finally:
        report.revert()
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grads, want_grads, rtol=1e-3, atol=1e-5)

    stepped = _peft_llama()
    adapters = [p for n, p in stepped.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(adapters, lr=0.0)  # (the step's loss, its weights unmoved)
    batch = {"input_ids": ids, "labels": ids}
    step, report = xpt.make_train_step(stepped, lambda out, _: out.loss, optimizer, batch,
                                       {**policy, "cuda_graph": False})  # fmt: skip
    try:
        assert len(report.fp8_bases) == 14
        loss = step(batch).item()
    finally:
        report.revert()
    assert loss == pytest.approx(want_loss, rel=1e-3)


@pytest.mark.gpu
@needs_fp8
@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a CUDA GPU")
@pytest.mark.parametrize("kept", [False, True], ids=["bf16-activations", "fp8-activations"])
def test_a_graphed_lora_step_over_stored_bases_replays_as_the_eager_step(kept):
    """``make_train_step(..., cuda_graph=True)`` over stored bases: the FP8 GEMMs, the
    per-token casts and the stored bytes' transpose are captured and replayed, and the
    step trains as the eager one; with gate and up kept in FP8 too (the activation then
    hands the MLP's projections their casts)."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    batch = {"input_ids": ids, "labels": ids}
    results = []
    for graph in (False, True):
        model = _peft_llama()
        adapters = [p for n, p in model.named_parameters() if "lora_" in n]
        optimizer = torch.optim.AdamW(adapters, lr=1e-2, fused=True, capturable=graph)
        policy = {"precision": "fp8", "fp8_base": True, "fp8_activations": kept,
                  "cuda_graph": graph}  # fmt: skip
        step, report = xpt.make_train_step(model, lambda out, _: out.loss, optimizer, batch,
                                           policy)  # fmt: skip
        try:
            assert isinstance(step, xpt.GraphedTrainStep) == graph
            assert len(report.fp8_bases) == 14
            results.append([step(batch).item() for _ in range(4)])
            decided = ROUTED_OPS["lora_linear"].decisions.values()
            assert {d.chosen for d in decided} == {"fp8"}
        finally:
            report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, rel=1e-2), (graphed, eager)
    assert graphed[-1] < graphed[0]


@needs_fp8
def test_adapters_trained_over_stored_bases_save_load_and_merge(fp8_here, tmp_path):
    """What peft does with the adapters after training over stored bases: they save and
    load into a fresh model as they are; after ``revert`` (dense bases of the stored,
    rounded values) ``merge_and_unload`` gives a plain model computing what the stored
    one did."""
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model = _peft_llama()
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        lora_step(model, ids)  # a training step's forward and backward over the stored bases
        model.save_pretrained(tmp_path)
        stored = _eval_logits(model, ids)
        # Merged into the stored bases, the adapters' update would round away: refused,
        # nothing written.
        with pytest.raises(UnsupportedOperationError, match="revert"):
            model.merge_and_unload()
        assert any("lora_" in n for n, _ in model.named_parameters())
    finally:
        report.revert()
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path)
    saved = {n: p for n, p in model.named_parameters() if "lora_" in n}
    for name, p in loaded.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(p, saved[name], rtol=0, atol=0)
    merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    _assert_alike(_eval_logits(merged, ids), stored)


@needs_fp8
def test_a_peft_llamas_state_dict_over_stored_bases_saves_and_loads_as_plain_tensors(
    fp8_here, tmp_path
):
    """A transformers Llama under peft, optimized with ``fp8_base`` and trained a step:
    ``torch.save(model.state_dict())`` loads with ``torch.load``'s default
    ``weights_only``, every value a plain tensor, and a fresh peft model given it computes
    what the stored one did."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model = _peft_llama()
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        assert report.fp8_bases
        lora_step(model, ids)
        torch.save(model.state_dict(), tmp_path / "state.pt")
        stored = _eval_logits(model, ids)
    finally:
        report.revert()
    state = torch.load(tmp_path / "state.pt")
    assert all(type(v) is torch.Tensor for v in state.values())
    fresh = _peft_llama()
    fresh.load_state_dict(state)
    _assert_alike(_eval_logits(fresh, ids), stored)


def _eval_logits(model, ids) -> torch.Tensor:
    """``model``'s logits for ``ids`` in eval mode, without gradients, under bf16 autocast."""
    model.eval()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        return model(input_ids=ids).logits.float()


def _assert_alike(logits: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.nn.functional.cosine_similarity(logits.flatten(), want.flatten(), dim=0) > 0.999


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a device without FP8")
def test_fp8_base_is_refused_with_the_reason_and_the_model_untouched():
    model = _peft_llama()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(BackendUnavailableError, match="fp8_base: FP8 GEMMs need .*not the cpu"):
        xpt.optimize(model, {"precision": "fp8", "fp8_base": True, "strict": True})
    assert {n: p for n, p in model.named_parameters()} == before
    assert "forward" not in vars(model.base_model.model.model.layers[0].self_attn.q_proj)
    with pytest.raises(PolicyError, match="fp8_base: needs precision='fp8'"):
        xpt.optimize(model, {"precision": "bf16", "fp8_base": True, "strict": True})
    _stores_nothing(model, "fp8_base: FP8 GEMMs need")


@needs_fp8
def test_a_model_without_lora_layers_is_told_fp8_base_stored_nothing(fp8_here):
    _stores_nothing(_llama(), "fp8_base: no fused LoRA layer")


def _stores_nothing(model, why: str) -> None:
    """``optimize`` with ``fp8_base`` stores no weight of ``model`` and says ``why``."""
    report = xpt.optimize(model, {"precision": "fp8", "fp8_base": True})
    try:
        assert report.fp8_bases == []
        assert any(why in said for _, said in report.skipped)
        assert all(type(p) is not Fp8Weight for p in model.parameters())
    finally:
        report.revert()


def test_the_policy_takes_saves_and_shows_fp8_base(tmp_path):
    policy = KernelPolicy(precision="fp8", fp8_base=True)
    policy.save(tmp_path / "p.json")
    assert KernelPolicy.load(tmp_path / "p.json") == policy
    assert "fp8_base=True" in repr(policy)
    assert "fp8_base" not in KernelPolicy(precision="fp8").to_dict()  # (fingerprints kept)
    with pytest.raises(PolicyError, match="fp8_base: expected True or False"):
        KernelPolicy(fp8_base="yes")

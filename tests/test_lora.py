"""LoRA fine-tuning through optimize(): peft's adapters on every linear layer of models
built from transformers configs (Triton's interpreter on the CPU). Each adapted layer
runs as the ``lora_linear`` op (its low-rank term accumulated into the base GEMM, one
autograd node), the MLP's SwiGLU/GeGLU stays fused under peft's wrappers, and training
gives the unoptimized peft model's loss and adapter gradients (with dropout, the
``torch`` kernel draws the masks peft draws, the fused one its own); what the op does not cover (several adapters at once, a dropout other
than nn.Dropout) runs as peft writes it and the report says so; peft's own operations
keep working."""

from __future__ import annotations

import copy
import gc
import importlib
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("triton")

from host_reads import host_reads  # noqa: E402
from kept_for_backward import kept_for_backward  # noqa: E402
from tensors_made import tensors_made  # noqa: E402
from tiny_configs import SMALL  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("our kernels run on the CPU under TRITON_INTERPRET=1", allow_module_level=True)

_GEMMA3 = {"layer_types": ["sliding_attention", "full_attention"]}
# extra config; per layer: adapted layers, joined groups, our nodes; the gated finding
_FAMILIES = {
    "llama": ({}, 7, 2, 4, "fused_swiglus"),  # nodes: q/k/v, o, gate/up, down
    "qwen3": ({}, 7, 2, 4, "fused_swiglus"),
    "gemma3_text": (_GEMMA3, 7, 2, 4, "fused_geglus"),
    "phi3": ({}, 4, 0, 4, "fused_swiglus"),  # qkv_proj, o_proj, gate_up_proj, down_proj
}


def _peft_pair(model_type: str, dropout: float = 0.0, adapters: int = 1, dtype=torch.float32):
    """A tiny model with LoRA on all linear layers, and an untouched copy (the base in
    ``dtype``; peft keeps the adapters in fp32)."""
    from peft import LoraConfig, get_peft_model

    extra = _FAMILIES[model_type][0]
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, dtype)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
        model = get_peft_model(base, lora)
        for i in range(1, adapters):
            model.add_adapter(
                f"second{i}", LoraConfig(r=2, lora_alpha=3, target_modules="all-linear")
            )
        _trained(model)
        models.append(model)
    return models


def _trained(model) -> None:
    """Adapters as trained ones are: B no longer zero (the same values in every copy)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))


def _batch():
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return ids


def _step(model, seed=0):
    torch.manual_seed(seed)
    ids = _batch()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss


def _lora_nodes(loss) -> int:
    """How many of our lora_linear nodes (one per layer or joined group) the loss's graph
    holds."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "LoraJoined" in node.name()
        stack += [next_node for next_node, _ in node.next_functions]
    return count


def _adapter_grads_close(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if "lora_" not in name:
            assert p.grad is None or not p.requires_grad, name  # the frozen base
        elif p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_every_adapted_layer_runs_as_one_op_and_trains_as_peft_does(model_type):
    model, reference = _peft_pair(model_type)
    report = xpt.optimize(model)
    _, per_layer, joins, nodes, gated = _FAMILIES[model_type]
    assert len(report.fused_loras) == 2 * per_layer, report.fused_loras
    assert len(getattr(report, gated)) == 2  # the MLP's activation, under peft's wrappers
    # q/k/v, and gate and up, run as one node each: their base GEMMs and A joined
    assert len(report.joined_projections) == 2 * joins, report.joined_projections
    assert "LoRA layer(s)" in str(report).splitlines()[0]
    loss, want = _step(model), _step(reference)
    assert _lora_nodes(loss) == 2 * nodes
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_the_mlps_activation_reads_the_joined_gate_and_up_whole(model_type, monkeypatch):
    """gate and up come back as the halves of one output of their own shape: the
    activation takes it packed (no copy of either half, forward or backward)."""
    kernels = importlib.import_module("xpuruntime.pytorch._ops.swiglu")
    calls = []
    for table, kind in ((kernels._PACKED, "packed"), (kernels._GATED, "halves")):
        for name, op in list(table.items()):
            monkeypatch.setitem(
                table, name, lambda *a, op=op, kind=kind: calls.append(kind) or op(*a)
            )
    model, reference = _peft_pair(model_type)
    xpt.optimize(model)
    loss, want = _step(model), _step(reference)
    assert calls == ["packed", "packed"]  # one per layer
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def _base_casts(model, run) -> int:
    """How many bf16 copies of the frozen base weights (alone or joined) ``run()`` makes."""
    shapes = set()
    for layer in model.base_model.model.model.layers:
        for group in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)):
            parent = layer.mlp if group[0] in ("gate", "up", "down") else layer.self_attn
            weights = [getattr(parent, f"{g}_proj").base_layer.weight for g in group]
            shapes.add((sum(w.shape[0] for w in weights), weights[0].shape[1]))
    with tensors_made() as made:
        run()
    copies = {
        t.untyped_storage().data_ptr()
        for t in made
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
    }  # one per address: an empty tensor, then a cat into it
    return len(copies)


def test_a_frozen_fp32_bases_casts_are_kept_between_steps_while_they_are_exact():
    """Under autocast the base is cast once, not in every step; a base changed in place
    is cast again (the step then trains as peft on the changed base); nothing is kept
    where it would cost memory: without autograd, or under gradient checkpointing."""
    model, reference = _peft_pair("llama")
    report = xpt.optimize(model)

    def step(m):
        with torch.autocast(DEVICE, torch.bfloat16):
            return _step(m)

    assert _base_casts(model, lambda: step(model)) == 8  # q/k/v, o, gate/up, down; 2 layers
    assert _base_casts(model, lambda: step(model)) == 0
    with torch.no_grad():  # in place, as load_state_dict or a merge writes it
        for m in (model, reference):
            m.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight.mul_(0.5)
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    loss = None

    def changed():
        nonlocal loss
        loss = step(model)

    assert _base_casts(model, changed) == 1
    torch.testing.assert_close(loss, step(reference), atol=2e-2, rtol=2e-2)
    with torch.no_grad(), torch.autocast(DEVICE, torch.bfloat16):  # an evaluation
        ids = _batch()
        assert _base_casts(model, lambda: model(input_ids=ids, labels=ids)) == 8  # not kept
    kept = importlib.import_module("xpuruntime.pytorch._ops._infra._frozen_casts")._kept
    gc.collect()  # (earlier tests' models, in reference cycles, may not be collected yet)
    assert len(kept) == 8  # one per group: q/k/v, o, gate/up, down; 2 layers
    report.revert()  # the model runs as written: nothing kept for it
    assert len(kept) == 0
    fresh, _ = _peft_pair("llama")
    fresh.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    xpt.optimize(fresh)
    step(fresh)
    assert _base_casts(fresh, lambda: step(fresh)) == 16  # forward and recompute, each step


def _bases(model, group):
    layer = model.base_model.model.model.layers[0]
    parent = layer.mlp if group[0] == "gate" else layer.self_attn
    return [getattr(parent, f"{name}_proj").base_layer.weight for name in group]


def _joins(model, run) -> int:
    """How many joined copies of q/k/v's or gate/up's weights ``run()`` makes."""
    shapes = set()
    for group in (("q", "k", "v"), ("gate", "up")):
        weights = _bases(model, group)
        shapes.add((sum(w.shape[0] for w in weights), weights[0].shape[1]))
    with tensors_made() as made:
        run()
    return len({id(t) for t in made if tuple(t.shape) in shapes})


def test_a_frozen_bases_groups_are_stored_as_one_tensor_and_joined_without_a_copy(tmp_path):
    """q/k/v's and gate/up's frozen bf16 weights are moved into one tensor each: no step
    copies them to join them, and the step trains as one whose weights are copied to be
    joined. A weight given new data is joined by a copy again; one written in place is
    read where it lies; the state dict saves and loads by torch.save and safetensors;
    revert gives each weight its own storage."""
    from safetensors.torch import load_file, save_file

    def step(m):
        with torch.autocast(DEVICE, torch.bfloat16):  # (peft's adapters are fp32)
            return _step(m)

    model, reference = _peft_pair("llama", dtype=torch.bfloat16)
    report = xpt.optimize(model)
    xpt.optimize(reference)
    with torch.no_grad():
        for p in reference.parameters():
            p.data = p.data.clone()  # each in a storage of its own: joined by copies
    # Each group's in the forward and again in the backward, but the first layer's q/k/v
    # (its input's gradient unneeded: the embedding is frozen).
    assert _joins(reference, lambda: step(reference)) == 7
    assert report.stored_joined == [
        f"base_model.model.model.layers.{i}.{group}"
        for i in range(2) for group in ("self_attn: q_proj, k_proj, v_proj", "mlp: gate_proj, up_proj")
    ]  # fmt: skip
    for group in (("q", "k", "v"), ("gate", "up")):
        weights = _bases(model, group)
        assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
        assert all(w.is_leaf and not w.requires_grad for w in weights)
    assert _joins(model, lambda: step(model)) == 0
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    torch.testing.assert_close(step(model), step(reference), atol=0, rtol=0)
    _adapter_grads_close(model, reference)

    with torch.no_grad():
        for m in (model, reference):
            m.base_model.model.model.layers[0].self_attn.k_proj.base_layer.weight.mul_(0.5)
    assert _joins(model, lambda: step(model)) == 0  # written in place: still joined
    for m in (model, reference):
        q = m.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        q.data = q.data * 2  # new data (as .to(), assign=True or a safe merge give)
    assert _joins(model, lambda: step(model)) == 1  # the forward's, by a copy again
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    torch.testing.assert_close(step(model), step(reference), atol=0, rtol=0)
    _adapter_grads_close(model, reference)

    state = model.state_dict()
    torch.save(state, tmp_path / "state.pt")
    save_file({k: v for k, v in state.items() if "layers.1." in k}, tmp_path / "state.safetensors")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    stored = load_file(tmp_path / "state.safetensors")
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert all(torch.equal(stored[k], state[k].cpu()) for k in stored)
    gate_up = _bases(model, ("gate", "up"))
    values = [w.clone() for w in gate_up]
    report.revert()
    assert len({w.untyped_storage().data_ptr() for w in gate_up}) == 2
    assert all(torch.equal(w, v) for w, v in zip(gate_up, values))

    fresh, _ = _peft_pair("llama", dtype=torch.bfloat16)
    xpt.optimize(fresh)
    merged = fresh.merge_and_unload()  # (in place into the stored rows, or as new data)
    merged.save_pretrained(tmp_path / "merged")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    want = merged.state_dict()
    assert all(torch.equal(v, want[k].cpu()) for k, v in again.state_dict().items())


@pytest.mark.parametrize("autocast", [True, False])
def test_an_optimized_peft_model_breaks_its_trace_only_at_the_head(autocast):
    """Nothing the fused path asks (a kept cast, the joined halves) breaks the trace: its
    only breaks are at the head, which runs with its loss outside the graph (once where
    dynamo inlines the forward, once where it traces it as a frame of its own)."""
    model, _ = _peft_pair("llama")
    xpt.optimize(model)
    ids = _batch()

    def loss(ids):
        with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, labels=ids).loss

    explained = torch._dynamo.explain(loss)(ids)
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert all("outside_the_graph" in r for r in reasons), [r[:200] for r in reasons]


def test_a_bf16_base_with_peft_upcast_adapters_runs_fused_under_autocast_and_as_peft_without():
    # How most load a LoRA base: bf16 weights; peft upcasts its adapters to fp32.
    model, reference = _peft_pair("llama", dtype=torch.bfloat16)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    report = xpt.optimize(model)
    assert len(report.fused_loras) == 14, report
    truth = copy.deepcopy(reference).to(torch.float64)
    _step(truth)
    with torch.autocast(DEVICE, torch.bfloat16):  # what training under autocast computes
        loss, want = _step(model), _step(reference)
    assert _lora_nodes(loss) == 8
    torch.testing.assert_close(loss, want, atol=2e-2, rtol=2e-2)

    def error(m) -> float:  # of the adapter gradients, against float64
        pairs = [(p.grad, t.grad) for p, t in zip(m.parameters(), truth.parameters()) if t.grad is not None]  # fmt: skip
        wrong = sum(float(((g.double() - t) ** 2).sum()) for g, t in pairs)
        return (wrong / sum(float((t**2).sum()) for _, t in pairs)) ** 0.5

    # This tiny model's bf16 gradients are off by about 16% under peft itself.
    assert error(model) <= 1.5 * error(reference)
    model.zero_grad(), reference.zero_grad()
    kept = {}  # bytes kept for the backward, the parameters' own storage not counted
    for name, m in (("ours", model), ("peft", reference)):

        def run(m=m):
            with torch.autocast(DEVICE, torch.bfloat16):
                return m(input_ids=_batch(), labels=_batch(), use_cache=False)

        kept[name] = kept_for_backward(run, m.parameters())
    # The base weights joined again in the backward (no bf16 copies of bf16 weights).
    assert kept["ours"] < kept["peft"], kept
    loss, want = _step(model), _step(reference)  # no autocast: two dtypes, peft's chain
    assert _lora_nodes(loss) == 0  # (the norms, SwiGLU and the head still ours, in bf16)
    torch.testing.assert_close(loss, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("base", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_normed_inputs_are_made_again_from_what_the_norms_keep(model_type, base, monkeypatch):
    """q/k/v's and gate/up's input (a norm's output, cast to bf16 under autocast) is
    made again in the LoRA op's backward from the norm's input, which the norm's
    backward keeps anyway: one bf16 activation less per norm (none for the first, whose
    input has no gradient), the same gradients to the bit."""
    from xpuruntime.pytorch._ops import fused_rmsnorm

    model, _ = _peft_pair(model_type, dtype=base)
    xpt.optimize(model)
    kept, grads = {}, {}
    for how in ("made again", "kept"):
        if how == "kept":  # the norms' outputs not marked: the LoRA op keeps them
            monkeypatch.setattr(fused_rmsnorm, "mark_normed", lambda *args: None)
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, torch.bfloat16):  # the adapters are fp32, as peft keeps them
            kept[how] = kept_for_backward(lambda: _step(model), model.parameters())
        grads[how] = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(g, h) for g, h in zip(grads["made again"], grads["kept"]))
    activation = _batch().numel() * SMALL["hidden_size"] * 2  # bf16
    norms = 2 * SMALL["num_hidden_layers"] - 1
    assert kept["kept"] - kept["made again"] == norms * activation, kept


def test_dropout_is_fused_and_trains_alike_when_seeded_alike():
    """The fused kernel draws the masks inside its GEMMs (their arithmetic is checked
    against float64 in test_lora_linear): every adapted layer stays one node, a seeded
    step repeats exactly, another seed draws other masks, and eval turns dropout off."""
    model, reference = _peft_pair("llama", dropout=0.1)
    model.train(), reference.train()
    report = xpt.optimize(model)
    assert len(report.fused_loras) == 14 and len(report.joined_projections) == 4
    assert len(report.fused_swiglus) == 2
    loss = _step(model, seed=3)
    assert _lora_nodes(loss) == 8
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    torch.testing.assert_close(_step(model, seed=3), loss, atol=0, rtol=0)
    again = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(g, h) for g, h in zip(grads, again))
    assert not torch.allclose(_step(model, seed=4), loss)
    assert not torch.allclose(loss, _step(reference, seed=3))  # peft draws other masks
    model.eval(), reference.eval()
    with torch.no_grad():
        ids = _batch()
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_the_torch_kernel_draws_the_masks_peft_draws():
    """Under a policy naming the ``torch`` kernel, each layer's mask is peft's: a seeded
    step gives peft's loss and adapter gradients."""
    model, reference = _peft_pair("llama", dropout=0.1)
    model.train(), reference.train()
    xpt.optimize(model, {"kernels": {"lora_linear": "torch"}})
    loss, want = _step(model, seed=3), _step(reference, seed=3)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert _lora_nodes(loss) == 0
    _adapter_grads_close(model, reference)


def test_a_dropout_other_than_nn_dropout_runs_as_peft_writes_it_and_the_report_says_why():
    model, _ = _peft_pair("llama", dropout=0.1)
    for module in model.modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            module.lora_dropout["default"] = torch.nn.AlphaDropout(0.1)
    report = xpt.optimize(model)
    assert report.fused_loras == []
    skipped = dict(report.skipped)
    assert "AlphaDropout" in skipped["base_model.model.model.layers.0.self_attn.q_proj"]


def test_peft_adapter_switches_and_merging_keep_working_after_optimize():
    model, reference = _peft_pair("llama", adapters=2)
    report = xpt.optimize(model)
    ids = _batch()
    for m in (model, reference):
        m.set_adapter("second1")  # the other adapter: read at each call
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        with model.disable_adapter(), reference.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    loss = _step(model)
    assert _lora_nodes(loss) == 8  # per layer: q/k/v, o, gate/up, down
    merged, want = model.merge_and_unload(), reference.merge_and_unload()
    for (name, p), q in zip(merged.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    report.revert()


def test_save_pretrained_and_revert_give_what_peft_alone_gives(tmp_path):
    from safetensors.torch import load_file

    model, reference = _peft_pair("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = xpt.optimize(model)
    model.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "peft")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    report.revert()
    assert not any("forward" in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_policy_naming_torch_leaves_the_adapters_as_peft_writes_them():
    model, reference = _peft_pair("llama")
    report = xpt.optimize(model, {"kernels": {"lora_linear": "torch"}})
    assert report.fused_loras == [] and len(report.fused_swiglus) == 2
    loss = _step(model)
    assert _lora_nodes(loss) == 0
    torch.testing.assert_close(loss, _step(reference), atol=1e-5, rtol=1e-5)


def test_optimize_before_peft_trains_as_peft_and_a_second_optimize_binds_the_adapters():
    """optimize first, then get_peft_model (the other order): the bound forwards call
    their layers at each call, so peft's wrappers run, q/k/v and gate/up as the
    lora_linear op's groups, and the model trains as peft's; optimizing again binds the
    adapters the first call could not see."""
    from peft import LoraConfig, get_peft_model

    extra = _FAMILIES["llama"][0]
    config = transformers.AutoConfig.for_model("llama", **{**SMALL, **extra})
    models = []
    for first in (True, False):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        report = xpt.optimize(base) if first else None
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        model = get_peft_model(base, lora)
        _trained(model)
        models.append((model, report))
    (model, report), (reference, _) = models
    loss = _step(model)
    assert _lora_nodes(loss) == 4  # per layer, the q/k/v and gate/up groups
    torch.testing.assert_close(loss, _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)
    again = xpt.optimize(model)
    assert len(again.fused_loras) == 14
    model.zero_grad(), reference.zero_grad()
    loss = _step(model)
    assert _lora_nodes(loss) == 8
    torch.testing.assert_close(loss, _step(reference), atol=1e-5, rtol=1e-5)
    again.revert(), report.revert()


def test_packed_sequences_keep_every_fusion_and_train_as_peft(monkeypatch):
    """TRL's padding-free batches: documents packed into one row, position_ids restarting
    at each; the rope op takes the angles those positions give, and the step matches."""
    from xpuruntime.pytorch._functional import _rope

    model, reference = _peft_pair("llama")
    report = xpt.optimize(model)
    assert len(report.fused_ropes) == 2
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0).to(DEVICE)
    want = reference(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss
    want.backward()
    calls = []
    routed = _rope._rope
    monkeypatch.setattr(_rope, "_rope", lambda *args: calls.append(1) or routed(*args))
    loss = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss
    loss.backward()
    assert len(calls) == 2  # the rope op, once per layer
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


@pytest.mark.parametrize("path", ["eager", "compile", "checkpointing"])
def test_a_packed_peft_model_attends_within_documents_as_peft_does_on_any_path(path):
    """A peft-wrapped model on a packed row (heads of 16, which our document kernel
    takes, fp16): eager runs attention within each document on our kernel, never
    building transformers' mask; compiled on the first call, transformers' mask; with
    gradient checkpointing, the recompute reads the documents again. Loss and adapter
    gradients are peft's on transformers' mask in every case."""
    from peft import LoraConfig, get_peft_model

    from xpuruntime.pytorch._functional._documents import DocumentMask

    config = transformers.AutoConfig.for_model(
        "llama", **{**SMALL, "head_dim": 16, "use_cache": False}
    )
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.float16)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        _trained(model)
        models.append(model)
    model, reference = models
    if path == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    report = xpt.optimize(model)
    assert report.packed_masks_as_documents == ["base_model.model.model"]
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    positions = torch.cat([torch.arange(10), torch.arange(3), torch.arange(11)])[None].to(DEVICE)
    want = reference(input_ids=ids, labels=ids, position_ids=positions).loss
    want.backward()
    run = torch.compile(model, backend="aot_eager") if path == "compile" else model
    made = []
    original = DocumentMask.materialize
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DocumentMask, "materialize", lambda m: made.append(1) or original(m))
        loss = run(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
    assert made == []
    torch.testing.assert_close(loss.float(), want.float(), atol=2e-3, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if "lora_" in name:
            scale = q.grad.float().abs().max().clamp(min=1e-3)
            assert (p.grad.float() - q.grad.float()).abs().max() / scale < 2e-2, name


def test_a_graphed_step_prepares_a_peft_gemma3s_masks_as_the_models_own():
    """A graphed step of a peft model whose layers take masks of several kinds calls it
    with the masks built before capture and no KV cache, as it calls the model peft
    wraps (the training cache's sliding layers copy a host tensor to the device, which
    a capture cannot hold): loss and adapter gradients are peft's, nothing is read back."""
    from xpuruntime.pytorch._training._transformers import prepared_forward

    model, reference = _peft_pair("gemma3_text")
    xpt.optimize(model)
    ids = _batch()
    prepared = prepared_forward(model, (ids,))
    assert prepared is not None and set(prepared.masks) == set(_GEMMA3["layer_types"])

    def loss_of(forward):
        return forward(ids).logits.float().logsumexp(-1).mean()

    assert prepared.agrees(loss_of)
    with host_reads() as reads:
        loss = loss_of(prepared)
    assert reads == []
    loss.backward()
    want = loss_of(lambda x: reference(x, use_cache=False))
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("path", ["compile", "checkpointing"])
def test_a_peft_model_compiled_or_checkpointed_after_optimize_trains_as_peft(path, dropout):
    """The paths users take with LoRA: torch.compile on the first call after optimize,
    and transformers' gradient checkpointing (non-reentrant), with and without dropout
    (the recomputed forward draws the masks the first drew)."""
    model, reference = _peft_pair("llama", dropout=dropout)
    if path == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    report = xpt.optimize(model)
    assert len(report.fused_loras) == 14
    if dropout:  # our masks are not peft's: the same model, eager and not checkpointed
        xpt.optimize(reference)
    run = torch.compile(model, backend="aot_eager") if path == "compile" else model
    torch.testing.assert_close(_step(run), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def test_trls_sft_trainer_on_an_optimized_peft_model_trains_as_without_optimize():
    """TRL's SFTTrainer with a peft_config, optimize() on the model it wrapped: its own
    fused head (which reads lm_head.weight) computes the loss from our layers' hidden
    states; the losses and token accuracies are those of the unoptimized run, and
    nothing materialises the logits."""
    # trl 1.15 (which Unsloth's carry brings to the GPU machine) runs its Triton log-prob
    # kernel on this CPU model's tensors when a GPU is present; 1.16 checks the device.
    pytest.importorskip("trl", minversion="1.16")
    import tempfile
    import warnings

    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    def train(optimized: bool):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("llama", **SMALL)
        model = transformers.AutoModelForCausalLM.from_config(config)
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, 96, (16,), generator=g).tolist() for _ in range(8)]
        words = Tokenizer(models.WordLevel({str(i): i for i in range(96)}, unk_token="0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=words, pad_token="0", bos_token="1", eos_token="2", unk_token="0"
        )
        args = SFTConfig(
            output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=4,
            learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no",
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        )  # fmt: skip
        report = xpt.optimize(trainer.model) if optimized else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        logged = [(e["loss"], e["mean_token_accuracy"]) for e in trainer.state.log_history
                  if "loss" in e]  # fmt: skip
        return report, logged, [str(w.message) for w in caught]

    report, ours, said = train(True)
    _, theirs, _ = train(False)
    assert len(report.fused_loras) == 14 and len(report.fused_swiglus) == 2
    assert not any("materialised" in message for message in said)
    assert len(ours) == len(theirs) == 3
    for (loss, accuracy), (want, want_accuracy) in zip(ours, theirs):
        assert loss == pytest.approx(want, rel=1e-4)
        assert accuracy == pytest.approx(want_accuracy)


def _four_bit(model, quantized_from=None):
    """``model`` with every decoder linear layer replaced by bitsandbytes' Linear4bit
    (nf4, fp32 compute) holding the same weights, quantized (from ``quantized_from``,
    where given: the dtype a model was loaded in): a QLoRA base built on the CPU
    (transformers' quantized loading wants a GPU)."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name.endswith("_proj"):
                quantized = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None,
                    compute_dtype=torch.float32, quant_type="nf4",
                )  # fmt: skip
                weight = child.weight.data.to(quantized_from or child.weight.dtype, copy=True)
                quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
                setattr(module, child_name, quantized.to(DEVICE))
    model.is_loaded_in_4bit = True  # what peft reads to wrap the layers as QLoRA's
    return model


def _four_bit_pair(quantized_from=None):
    """A tiny 4-bit Llama with LoRA on all linear layers, and an untouched copy."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        # Rows of 64 and outputs of 32 or more: bitsandbytes' CPU kernels take no fewer.
        wide = {**SMALL, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
        config = transformers.AutoConfig.for_model("llama", **wide)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        base = _four_bit(base, quantized_from)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        _trained(model)
        models.append(model)
    return models


def test_a_4bit_base_qlora_runs_as_one_op_per_group_and_trains_as_peft():
    """QLoRA: peft's adapters over bitsandbytes' 4-bit layers. Each adapted layer runs as
    the lora_linear op (the base dequantized by bitsandbytes, again in the backward
    rather than kept), q/k/v and gate/up joined, SwiGLU fused; loss and adapter
    gradients are peft's; the policy's torch kernel runs bitsandbytes' own 4-bit GEMM."""
    model, reference = _four_bit_pair()
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    report = xpt.optimize(model)
    assert len(report.fused_loras) == 14, report
    assert len(report.joined_projections) == 4 and len(report.fused_swiglus) == 2
    states = [m.weight.quant_state for m in model.modules() if type(m).__name__ == "Linear4bit"]
    states = [s for s in states if s is not None]
    assert states and not any(getattr(s, "packing_format_for_cpu", False) for s in states)
    loss, want = _step(model), _step(reference)
    assert _lora_nodes(loss) == 8
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)
    report.revert()
    xpt.optimize(model, {"kernels": {"lora_linear": "torch"}})
    model.zero_grad(), reference.zero_grad()
    torch.testing.assert_close(_step(model), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


@pytest.mark.parametrize("path", ["compile", "checkpointing"])
def test_a_qlora_model_compiled_or_checkpointed_after_optimize_trains_as_peft(path):
    """QLoRA on the paths users take: torch.compile on the first call after optimize,
    and transformers' gradient checkpointing (non-reentrant)."""
    model, reference = _four_bit_pair()
    if path == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    assert len(xpt.optimize(model).fused_loras) == 14
    run = torch.compile(model, backend="aot_eager") if path == "compile" else model
    torch.testing.assert_close(_step(run), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def test_a_layer_peft_left_without_an_adapter_joins_q_and_v_in_one_node():
    """peft's default targets for Llama adapt q_proj and v_proj alone: k, frozen and
    without an adapter, joins them in one lora_linear node over their bases stored as
    one tensor (the MLP's layers, none adapted, are the projections op's). Loss and
    adapter gradients are peft's."""
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.for_model("llama", **SMALL)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        models.append(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
        _trained(models[-1])
    model, reference = models
    report = xpt.optimize(model)
    groups = [group.rsplit(": ", 1)[-1] for group in report.joined_projections]
    assert sorted(groups) == ["gate_proj, up_proj"] * 2 + ["q_proj, k_proj, v_proj"] * 2
    assert len(report.fused_loras) == 4 and len(report.stored_joined) == 4
    loss, want = _step(model), _step(reference)
    assert _lora_nodes(loss) == 2  # q/k/v, one a layer
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def _default_targets_pair(dropout: float = 0.0):
    """A tiny 4-bit Llama adapted by peft's default targets (q_proj and v_proj), and an
    untouched copy."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    wide = {**SMALL, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
    config = transformers.AutoConfig.for_model("llama", **wide)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = _four_bit(transformers.AutoModelForCausalLM.from_config(config).to(DEVICE))
        lora = LoraConfig(r=4, lora_dropout=dropout, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(base, lora)
        _trained(model)
        models.append(model)
    return models


def test_4bit_layers_peft_left_without_adapters_run_joined_with_their_groups_as_peft():
    """peft's default targets for Llama adapt q_proj and v_proj alone; over a 4-bit base
    k, o and the MLP stay bitsandbytes' own layers. They run as the lora_linear op
    without a term: k joined with q and v in one node, gate and up joined and their
    SwiGLU fused, o and down alone. Loss and adapter gradients are peft's. Under a
    policy that runs peft's chain the report names each with why."""
    model, reference = _default_targets_pair()
    report = xpt.optimize(model)
    bare = {path.rsplit(".", 1)[-1] for path in report.bare_4bit_layers}
    assert bare == {"k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, report
    assert len(report.bare_4bit_layers) == 10 and len(report.fused_loras) == 4
    assert len(report.joined_projections) == 4 and len(report.fused_swiglus) == 2
    assert not [why for _, why in report.skipped if "without a LoRA adapter" in why]
    loss, want = _step(model), _step(reference)
    assert _lora_nodes(loss) == 8  # per layer: q/k/v, o, gate/up, down
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)
    report.revert()
    report = xpt.optimize(model, {"kernels": {"lora_linear": "torch"}})
    said = {path.rsplit(".", 1)[-1] for path, why in report.skipped
            if "without a LoRA adapter" in why and "no lora_linear kernel" in why}  # fmt: skip
    assert said == {"k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    model.zero_grad(), reference.zero_grad()
    torch.testing.assert_close(_step(model), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def test_bare_4bit_layers_checkpointed_and_compiled_after_optimize_train_as_peft():
    """The default targets' QLoRA model on the paths users take at once: transformers'
    gradient checkpointing (non-reentrant) and torch.compile on the first call."""
    model, reference = _default_targets_pair()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    assert len(xpt.optimize(model).bare_4bit_layers) == 10
    run = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(_step(run), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def test_a_generated_token_without_gradients_leaves_bare_4bit_layers_to_bitsandbytes(
    monkeypatch,
):
    """One row without gradients (a generated token): bitsandbytes' own kernel reads a
    4-bit weight once, so layers without an adapter run as it writes them. With
    gradients the same row runs through the op."""
    from xpuruntime.pytorch._optimize.patterns import lora as pattern

    model, reference = _default_targets_pair()
    xpt.optimize(model)
    terms, real = [], pattern.lora_linear
    monkeypatch.setattr(pattern, "lora_linear", lambda x, b, t: terms.append(t) or real(x, b, t))
    ids = _batch()[:1, :1]
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        want = reference(input_ids=ids, use_cache=False).logits
    assert terms == []  # o, down alone, gate and up (a group without adapters): bitsandbytes'
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    model(input_ids=ids, use_cache=False)
    assert terms == [None] * 4  # o and down of each layer, through the op


def test_with_dropout_a_group_of_adapted_and_bare_4bit_layers_still_runs_as_one_node():
    """q and v's dropout is drawn in the op's kernels for them alone; k, without an
    adapter, draws none and stays in the group. Evaluated (dropout off) the model
    computes peft's loss."""
    model, reference = _default_targets_pair(dropout=0.1)
    xpt.optimize(model)
    loss = _step(model)
    assert _lora_nodes(loss) == 8 and torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval(), reference.eval()  # (gradients on: bitsandbytes' CPU kernels repack
    ids = _batch()  # a weight for a no-grad call, and compute it otherwise)
    got, want = (m(input_ids=ids, labels=ids, use_cache=False).loss for m in (model, reference))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantized_from", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_qlora_base_of_another_dtype_under_bf16_autocast_is_made_dense_once_a_group(
    quantized_from, monkeypatch
):
    """A model loaded in fp32 (or fp16) and quantized so, trained under bf16 autocast:
    each LoRA group's 4-bit base is made dense by one launch of its kept plan. From fp32
    it is written in bf16 (bitsandbytes' fp32 weights cast); from fp16 in fp16, then
    cast once. Before, each part was made by a launch of its own and cast after. The
    step is the same to the bit."""
    from xpuruntime.pytorch._ops import nf4

    launches = []

    class Counted:  # the pass's launches, counted on their way through
        def __init__(self, kernel):
            self.kernel = kernel

        def launch(self, *args, **kwargs):
            launches.append(1)
            return self.kernel.launch(*args, **kwargs)

        def __getitem__(self, grid):
            launches.append(1)
            return self.kernel[grid]

        def __getattr__(self, name):  # (the rest: the kernel's own)
            return getattr(self.kernel, name)

    monkeypatch.setattr(nf4, "_dequantize_4bit", Counted(nf4._dequantize_4bit))
    runs = {}
    for how in ("joined", "per weight"):
        if how == "per weight":  # (the path before: each part dense, then cast)
            monkeypatch.setattr(nf4, "joined_4bit", lambda weights, dtype: None)
        model, _ = _four_bit_pair(quantized_from)
        states = {m.weight.quant_state.dtype for m in model.modules()
                  if type(m).__name__ == "Linear4bit"}  # fmt: skip
        assert states == {quantized_from}
        xpt.optimize(model)
        launches.clear()
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = model(input_ids=_batch(), labels=_batch(), use_cache=False).loss
        forward = len(launches)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        runs[how] = forward, loss, grads
    assert runs["joined"][0] == 8  # 2 layers' q/k/v, o, gate/up and down
    assert runs["per weight"][0] == 14  # each of their 7 weights
    assert torch.equal(runs["joined"][1], runs["per weight"][1])
    assert all(torch.equal(a, b) for a, b in zip(runs["joined"][2], runs["per weight"][2]))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_down_projection_remakes_the_activation_rather_than_keep_it(dropout):
    """The SwiGLU keeps gate and up for its backward; the down projection's adapter then
    makes ``h = silu(gate) * up`` again in its backward instead of keeping it (Unsloth's
    LoRA MLP does the same): no tensor of the MLP's inner width is kept, and the
    gradients are the unoptimized model's."""
    model, reference = _peft_pair("llama", dropout=dropout)
    xpt.optimize(model, {"kernels": {"lora_linear": "fused"}})
    inner = model.base_model.model.config.intermediate_size
    tokens = _batch().numel()
    sizes = []  # of the activations kept (the weights' are smaller)

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=_batch(), labels=_batch(), use_cache=False).loss
    assert tokens * inner not in sizes  # no h kept
    assert tokens * 2 * inner in sizes  # gate and up, packed, kept for the SwiGLU
    loss.backward()
    if dropout:
        return  # our masks are not peft's: the arithmetic is the seeded test's above
    want = reference(input_ids=_batch(), labels=_batch(), use_cache=False).loss
    want.backward()
    torch.testing.assert_close(loss, want, atol=2e-5, rtol=1e-4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_down_adapters_gradient_is_read_from_gate_and_up_in_a_peft_model(
    model_type, monkeypatch
):
    """In a peft model under bf16 autocast, the down projection's adapter gradient comes
    from the SwiGLU's gate and up: the activation is never made again, and every
    gradient is the one made from the activation made again."""
    from xpuruntime.pytorch._ops import swiglu

    made = []
    launchers = dict(swiglu._AGAIN)

    def counted(name):
        def launch(*inputs):
            made.append(name)
            return launchers[name](*inputs)

        return launch

    monkeypatch.setattr(swiglu, "_AGAIN", {name: counted(name) for name in launchers})
    model, _ = _peft_pair(model_type, dtype=torch.bfloat16)
    xpt.optimize(model)
    grads = {}
    for how in ("read", "made again"):
        if how == "made again":  # no product offered: the LoRA op makes h again
            monkeypatch.setattr(swiglu, "_PRODUCTS", dict.fromkeys(swiglu._PRODUCTS))
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, torch.bfloat16):
            _step(model)
        grads[how] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert bool(made) == (how == "made again"), made
    assert grads["read"].keys() == grads["made again"].keys()
    for name, grad in grads["read"].items():
        # Only dA of down is summed another way. On the CPU the bf16 GEMM of the path made
        # again also rounds it to bf16 before writing fp32 (a CUDA GEMM writes fp32).
        tolerance = {"rtol": 1e-5, "atol": 1e-6}
        if "down_proj.lora_A" in name:
            tolerance = (
                {"rtol": 1e-2, "atol": 1e-4} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
            )
        torch.testing.assert_close(grad, grads["made again"][name], **tolerance, msg=name)


_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_VARIANTS = {  # peft's LoraConfig fields beyond r and alpha; whether optimize fuses them
    "rslora": ({"use_rslora": True}, True),
    "rank and alpha patterns": (
        {"rank_pattern": {"k_proj": 2, "up_proj": 8}, "alpha_pattern": {"v_proj": 3}},
        True,
    ),
    "pissa init": ({"init_lora_weights": "pissa"}, True),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, True),
    "lm_head adapted": ({"target_modules": [*_ALL, "lm_head"]}, True),
    "embedding adapted": ({"target_modules": [*_ALL, "embed_tokens"]}, True),
    "trainable tokens": ({"trainable_token_indices": [3, 5]}, True),
    "one layer of two": ({"layers_to_transform": [0]}, True),
    "dora": ({"use_dora": True}, False),
    "lora_bias": ({"lora_bias": True}, False),
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_peft_lora_variants_train_after_optimize_as_peft_trains_them(variant):
    """What peft's LoraConfig offers beyond r and alpha gives peft's loss and gradients
    after optimize: fused where the op computes it, as peft writes it (the report says
    why) where it does not."""
    from peft import LoraConfig, get_peft_model

    fields, fused = _VARIANTS[variant]
    config = transformers.AutoConfig.for_model("llama", **SMALL)
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        lora = LoraConfig(r=4, lora_alpha=8, **{"target_modules": _ALL, **fields})
        pair.append(get_peft_model(base, lora))
        with torch.no_grad():  # B as trained (an embedding's adapter: lora_embedding_B)
            for name, p in pair[-1].named_parameters():
                if "lora_B" in name or "lora_embedding_B" in name:
                    gen = torch.Generator().manual_seed(len(name))
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model, reference = pair
    report = xpt.optimize(model)
    assert bool(report.fused_loras) == fused, report.fused_loras
    if not fused:
        assert "runs as written" in str(report), str(report)
    torch.testing.assert_close(_step(model), _step(reference), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_lora_over_gpt2s_conv1d_runs_as_peft_writes_it_and_the_report_names_its_base():
    """GPT-2's layers are transformers' Conv1D ((in, out) weights), which the op does not
    read: each adapted layer is listed with its base's type, and trains as peft's."""
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=SMALL["vocab_size"]
    )
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
        pair.append(get_peft_model(base, lora))
        _trained(pair[-1])
    model, reference = pair
    report = xpt.optimize(model)
    assert report.fused_loras == []
    reasons = [why for path, why in report.skipped if path.endswith(("c_attn", "c_fc"))]
    assert len(reasons) == 4, report.skipped  # two layers of two adapted modules each
    assert all("its base, Conv1D, is not" in why and "runs as written" in why for why in reasons)
    torch.testing.assert_close(_step(model), _step(reference), atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_a_padded_batch_trains_as_peft_trains_it(model_type, padding):
    """A batch padded to its longest row, its mask as a tokenizer gives it (right or
    left), trains after optimize as under peft alone."""
    model, reference = _peft_pair(model_type)
    xpt.optimize(model)
    ids = _batch()
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[0, 9:] = 0
    else:
        mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for m in (model, reference):
        loss = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(*losses, atol=1e-5, rtol=1e-5)
    _adapter_grads_close(model, reference)


def test_embeddings_passed_in_place_of_ids_train_as_peft_trains_them():
    """``inputs_embeds`` (a prompt-tuning or multimodal caller's form) reaches the same
    loss and gradients after optimize, the embeddings' own gradient included."""
    model, reference = _peft_pair("llama")
    xpt.optimize(model)
    ids = _batch()
    grads = []
    for m in (model, reference):
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_()
        m(inputs_embeds=embeds, labels=ids, use_cache=False).loss.backward()
        grads.append(embeds.grad)
    # (fp32 rounding of gradients up to about 3: the BLAS of the CPU, AMD's or Intel's,
    # moves single elements by a few 1e-6)
    torch.testing.assert_close(*grads, atol=1e-4, rtol=1e-4)
    _adapter_grads_close(model, reference)

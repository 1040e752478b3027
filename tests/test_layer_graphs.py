"""The policy's graph_layers: decoder layers replaying CUDA graphs of their forward and
backward in plain training loops, against the same model run as written."""

import copy
import io
import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._graphs.layers import (  # noqa: E402
    SIGNATURES,
    GraphedLayer,
    LayerGraphs,
    _Places,
)
from xpuruntime.pytorch._graphs.waits import WATCHED, HostWaits, WatchedLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
gpu = pytest.mark.gpu
SHAPE = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 256, "pad_token_id": 0,
}  # fmt: skip


def _model(family="llama", lora=True, dropout=0.0, device="cuda"):
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model

        shape = SHAPE
    else:
        from transformers import Gemma3ForCausalLM as Model
        from transformers import Gemma3TextConfig as Config

        shape = {**SHAPE, "sliding_window": 16, "num_hidden_layers": 4}
    config = Config(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Model(config).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout)
        )
        for name, p in model.named_parameters():  # (B not zero: the adapters matter)
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return model


def _ids(rows=2, tokens=64, seed=1, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (rows, tokens), generator=g).to(device)


def _train(model, batches, accumulate=1, autocast=False):
    """A plain loop (fp32, or under bf16 autocast): the losses, and each optimizer step's
    gradients."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    losses, grads = [], []
    for i, ids in enumerate(batches):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            grads.append([p.grad.float().clone() for p in trained])
            optimizer.step()
            optimizer.zero_grad()
    return losses, grads


def _same(got, want, tolerance=1e-4):
    """Equal losses and gradients, step by step (fp32: the same kernels, replayed)."""
    torch.testing.assert_close(got[0], want[0], atol=tolerance, rtol=tolerance)
    for got_step, want_step in zip(got[1], want[1], strict=True):
        for g, w in zip(got_step, want_step, strict=True):
            scale = w.abs().max().item() or 1.0
            torch.testing.assert_close(g / scale, w / scale, atol=tolerance, rtol=0)


def _pair(**kwargs):
    """The model optimized as written, and a copy of it with graph_layers."""
    model = _model(**kwargs)
    graphed = copy.deepcopy(model)
    xpt.optimize(model)
    report = xpt.optimize(graphed, {"graph_layers": True})
    return model, graphed, report


def _layers(model):
    return [
        m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), GraphedLayer)
    ]


@gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_graphed_layers_train_as_the_layers_run_as_written(family, lora):
    """Three steps of a plain loop: the same losses and trained parameters, each layer
    replaying one signature's graphs (Gemma3: sliding and full layers, each with its
    own mask and rotary tables)."""
    model, graphed, report = _pair(family=family, lora=lora)
    assert len(report.graphed_layers) == (3 if family == "llama" else 4), str(report)
    batches = [_ids(seed=s) for s in range(3)]
    want = _train(model, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(graphed, batches)
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)]
    assert [layer.signatures for layer in _layers(graphed)] == [1] * len(report.graphed_layers)
    _same(got, want)


@gpu
def test_graphed_layers_under_bf16_autocast_train_as_the_layers_run_as_written():
    """The usual step (bf16 autocast over fp32 adapters): losses and gradients within
    bf16's rounding of the plain loop's."""
    model, graphed, _ = _pair()
    batches = [_ids(seed=s) for s in range(3)]
    _same(_train(graphed, batches, autocast=True), _train(model, batches, autocast=True), 2e-2)
    assert all(layer.signatures == 1 for layer in _layers(graphed))


@gpu
def test_gradient_accumulation_over_graphed_layers_sums_each_microbatch():
    """Two microbatches a step: each backward's gradients are fresh tensors, added to
    the parameters' as the plain loop adds them (not the graph's buffers, rewritten by
    the next replay)."""
    model, graphed, _ = _pair()
    batches = [_ids(seed=s) for s in range(4)]
    _same(_train(graphed, batches, accumulate=2), _train(model, batches, accumulate=2))
    assert all(layer.signatures == 1 for layer in _layers(graphed))


@gpu
def test_a_second_forward_before_the_backward_runs_as_written_and_says_so(caplog):
    """Two forwards, then one backward of their sum: the second call of each layer would
    overwrite what the first's backward reads, so it runs the layer's own forward; the
    gradients are the plain model's."""
    model, graphed, _ = _pair()
    first, second = _ids(seed=1), _ids(seed=2)
    for m in (model, graphed):
        _train(m, [first])  # (one step each: graphed captures)
    for m in (model, graphed):
        m.zero_grad(set_to_none=True)
    grads = []
    for m in (model, graphed):
        with caplog.at_level(logging.WARNING):
            loss = m(input_ids=first, labels=first).loss + m(input_ids=second, labels=second).loss
        loss.backward()
        grads.append([p.grad.float() for p in m.parameters() if p.requires_grad])
    assert "still waits for its backward" in caplog.text
    _same(([0.0], [grads[1]]), ([0.0], [grads[0]]))


@gpu
def test_a_forward_whose_loss_is_dropped_releases_its_graph():
    """A training-mode forward never backpropagated (a loss logged and dropped): the next
    forward replays again, nothing waits."""
    _, graphed, _ = _pair()
    ids = _ids()
    _train(graphed, [ids], autocast=True)
    with torch.autocast("cuda", torch.bfloat16):
        graphed(input_ids=ids, labels=ids).loss.item()
    assert all(layer.signatures == 1 for layer in _layers(graphed))
    assert not any(g.pending for layer in _layers(graphed) for g in layer._graphs.values())


@gpu
def test_lora_dropout_under_graphed_layers_draws_new_masks_each_replay():
    """A graph replays its dropout draws afresh (the seed is a device draw): the same
    batch twice gives two losses."""
    _, graphed, _ = _pair(dropout=0.2)
    ids = _ids()
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            loss = graphed(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] != losses[2]
    assert all(layer.signatures == 1 for layer in _layers(graphed))


@gpu
def test_new_shapes_are_captured_up_to_the_limit_then_run_as_written(caplog):
    """Each sequence length is a signature of its own; past SIGNATURES the layers run
    their own forward (logged), and every loss is the plain model's."""
    model, graphed, _ = _pair()
    lengths = [16 * (i + 1) for i in range(SIGNATURES + 1)]
    with caplog.at_level(logging.WARNING):
        got = _train(graphed, [_ids(tokens=t) for t in lengths])
    want = _train(model, [_ids(tokens=t) for t in lengths])
    assert f"more than {SIGNATURES} input signatures" in caplog.text
    assert {layer.signatures for layer in _layers(graphed)} == {SIGNATURES}
    _same(got, want)


@gpu
def test_a_trainer_over_graphed_layers_trains_as_over_the_layers_as_written(tmp_path):
    """transformers' Trainer, the loop most users run (gradient accumulation, its own
    loss and clipping): three steps give the same losses and adapters, the layers
    replaying one signature's graphs."""
    pytest.importorskip("accelerate")
    if torch.cuda.device_count() > 1:
        pytest.skip("Trainer runs DataParallel over several GPUs in one process")
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int) -> dict:
            ids = _ids(rows=1, seed=i, device="cpu")[0]
            labels = ids.clone()
            labels[: i % 4] = -100  # rows with different counts of ignored positions
            return {"input_ids": ids, "labels": labels}

    model, graphed, _ = _pair()
    results = []
    for name, m in (("as_written", model), ("graphed", graphed)):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3,
            gradient_accumulation_steps=2, logging_steps=1, report_to=[], save_strategy="no",
            seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=m, args=args, train_dataset=Batches())
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((losses, [p.detach().float() for p in m.parameters() if p.requires_grad]))
    assert len(results[1][0]) == 3
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-4, abs=1e-4)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(layer.signatures == 1 for layer in _layers(graphed))


@gpu
def test_evaluation_and_generation_run_the_layers_as_written():
    """eval() and no_grad calls capture nothing: generate gives the plain model's tokens."""
    model, graphed, _ = _pair()
    ids = _ids(rows=1, tokens=8)
    for m in (model, graphed):
        m.eval()
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        got = graphed.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert all(layer.signatures == 0 for layer in _layers(graphed))


@gpu
def test_a_backward_run_again_after_a_later_forward_is_refused():
    """retain_graph=True, another forward, then the first loss's backward again: the
    activations it reads are gone, and it says so rather than computing on them. (The
    decoder's hidden states' loss: the fused LM loss takes one backward.)"""
    _, graphed, _ = _pair()
    decoder = graphed.base_model.model.model
    ids = _ids()
    _train(graphed, [ids])
    loss = decoder(input_ids=ids, use_cache=False).last_hidden_state.pow(2).mean()
    loss.backward(retain_graph=True)
    decoder(input_ids=ids, use_cache=False).last_hidden_state.pow(2).mean().backward()
    with pytest.raises(xrt.InvalidInputError, match="retain_graph"):
        loss.backward()


class _Syncing(torch.nn.Module):
    """A layer whose forward waits for the device: a capture the driver fails."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        torch.cuda.synchronize()
        return self.linear(x)


@gpu
def test_a_capture_the_driver_fails_runs_the_layer_as_written_and_poisons_nothing(caplog):
    """The driver refuses the capture (a device sync inside): the call runs the layer's
    own forward (logged, with the last op captured), the next calls too, and random
    numbers still work after (PyTorch leaves its generator in capture mode otherwise)."""
    layer = _Syncing().cuda()
    layer.forward = GraphedLayer(layer, layer.forward, "layer", LayerGraphs())
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            layer(x).sum().backward()
    assert "not captured" in caplog.text
    assert layer.forward.signatures == 0
    torch.manual_seed(0)
    torch.randn(4, device="cuda").sum().item()
    torch.testing.assert_close(x.grad, 2 * layer.linear.weight.sum(0).expand(4, 16))


# -- the watch for a loop waiting on its host, without graph_layers --------------------------
def _steps(model, batches):
    """A plain loop that reads nothing back (no sync): its losses."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).cpu()


def _watched(model) -> int:
    """How many layers' forwards are watched."""
    return sum(isinstance(m.__dict__.get("forward"), WatchedLayer) for m in model.modules())


@gpu
def test_a_host_bound_loop_is_told_once_about_graph_layers_then_unwatched():
    """A tiny LoRA model's layers take the GPU less time than the host takes to queue
    them: one warning naming graph_layers after the watched steps, the watch then off
    and the losses those of the model as written (not optimized)."""
    model = _model()
    reference = copy.deepcopy(model)
    report = xpt.optimize(model)
    assert len(report.watched_layers) == 3, str(report)
    assert _watched(model) == 3
    batches = [_ids(seed=s) for s in range(WATCHED[-1] + 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _steps(model, batches)
    told = [w for w in caught if "waits on its host" in str(w.message)]
    assert len(told) == 1 and "graph_layers" in str(told[0].message)
    assert _watched(model) == 0
    reference_losses = _steps(reference, batches)
    torch.testing.assert_close(losses, reference_losses, atol=1e-3, rtol=1e-3)


@gpu
def test_a_loop_whose_gpu_is_behind_is_not_told():
    """Wide layers over long rows: the GPU queue stays several layers deep, so the watch
    finds it caught up at few boundaries and says nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, "hidden_size": 2048, "intermediate_size": 8192,
                            "num_attention_heads": 16, "num_key_value_heads": 8,
                            "head_dim": 128, "num_hidden_layers": 4,
                            "max_position_embeddings": 4096})  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    watch = HostWaits([(f"model.layers.{i}", m) for i, m in enumerate(model.model.layers)])
    batches = [_ids(rows=8, tokens=2048, seed=s) for s in range(WATCHED[-1] + 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(model, batches)
    caught_up, points = watch.caught_up
    assert points > 0 and not watch.watching
    assert not [w for w in caught if "waits on its host" in str(w.message)], (caught_up, points)


@gpu
def test_gradient_checkpointing_ends_the_watch_without_a_word():
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = xpt.optimize(model)
    assert report.watched_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(model, [_ids(seed=s) for s in range(WATCHED[-1] + 2)])
    assert _watched(model) == 0
    assert not [w for w in caught if "waits on its host" in str(w.message)]


@gpu
def test_revert_takes_the_watch_off():
    model = _model()
    report = xpt.optimize(model)
    assert _watched(model) == 3
    report.revert()
    assert _watched(model) == 0


# -- what runs on a CPU machine ------------------------------------------------------------
def test_a_model_on_the_cpu_is_not_watched():
    model = _model(lora=False, device="cpu")
    report = xpt.optimize(model)
    assert not report.watched_layers
    assert _watched(model) == 0


def test_a_watch_over_cpu_layers_ends_at_their_first_training_call_leaving_the_loss():
    """Layers moved off CUDA after the watch was put on: the first training call takes
    the watch off, and the loss is the model's own."""
    model = _model(lora=False, device="cpu")
    ids = _ids(device="cpu")
    want = model(input_ids=ids, labels=ids).loss
    watch = HostWaits([(f"model.layers.{i}", m) for i, m in enumerate(model.model.layers)])
    with torch.no_grad():  # (not training: nothing measured, the watch stays)
        model(input_ids=ids)
    assert watch.watching
    got = model(input_ids=ids, labels=ids).loss
    assert not watch.watching and watch.caught_up == (0, 0) and _watched(model) == 0
    torch.testing.assert_close(got, want)


def test_a_watched_model_saves_and_loads_with_its_forwards_as_written():
    model = _model(lora=False, device="cpu")
    layers = model.model.layers
    written = layers[0].forward
    watch = HostWaits([(f"model.layers.{i}", m) for i, m in enumerate(layers)])
    assert _watched(model) == len(layers)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _watched(loaded) == 0
    ids = _ids(device="cpu")
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    watch.end()
    assert model.model.layers[0].forward == written and "forward" not in layers[0].__dict__


# -- what runs on a CPU machine, graph_layers ------------------------------------------------
def test_graph_layers_is_a_policy_field_saved_only_when_on():
    policy = xrt.KernelPolicy(graph_layers=True)
    assert policy.to_dict()["graph_layers"] is True
    assert xrt.KernelPolicy.from_dict(policy.to_dict()) == policy
    assert "graph_layers" not in xrt.KernelPolicy().to_dict()
    assert "graph_layers=True" in repr(policy)
    with pytest.raises(xrt.PolicyError, match="graph_layers"):
        xrt.KernelPolicy(graph_layers="yes")


def test_a_model_on_the_cpu_reports_why_its_layers_are_not_graphed():
    model = _model(lora=False, device="cpu")
    report = xpt.optimize(model, {"graph_layers": True})
    assert not report.graphed_layers
    assert any("CUDA graphs need" in why for _, why in report.skipped), report.skipped


def test_a_graphed_layer_given_cpu_tensors_runs_as_written_pickles_as_its_forward(caplog):
    """A layer wrapped by hand on the CPU: the call runs the layer's forward (logged
    once), the model's loss is unchanged, and torch.save keeps the forward as written."""
    model = _model(lora=False, device="cpu")
    ids = _ids(device="cpu")
    want = model(input_ids=ids, labels=ids).loss
    shared = LayerGraphs()
    for i, layer in enumerate(model.model.layers):
        layer.forward = GraphedLayer(layer, layer.forward, f"model.layers.{i}", shared)
    with caplog.at_level(logging.WARNING):
        got = model(input_ids=ids, labels=ids).loss
        model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got, want)
    assert caplog.text.count("ran its own forward: a tensor argument on cpu") == 3
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not isinstance(loaded.model.layers[0].forward, GraphedLayer)
    torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss, want)


def test_a_rehearsal_takes_the_capture_paths_on_cuda_devices_only_and_ends_with_its_block():
    """A graph's last warm-up rehearses the capture: the ops then take the capture's paths
    (their kernels compiled and loaded before it), on CUDA devices only, until the block
    ends, an error included."""
    from xpuruntime.pytorch._ops._infra._capture_paths import capture_paths, rehearsal

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not capture_paths(cpu)
    with pytest.raises(RuntimeError, match="inside"), rehearsal():
        assert capture_paths(cuda) and not capture_paths(cpu)
        raise RuntimeError("inside")
    assert not capture_paths(cpu)


def test_a_layers_trained_parameters_stand_in_as_fresh_leaves_and_come_back_after_an_error():
    """The warm-ups and the capture take gradients for fresh leaves over the parameters'
    storage: a LoRA MLP's gradients for them are its parameters' own, a tied parameter's
    places share one leaf, and the module holds its parameters again after the block,
    an error included, their own gradients untouched."""
    mlp = _model(device="cpu").base_model.model.model.layers[0].mlp
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(2, 8, SHAPE["hidden_size"])
    want = torch.autograd.grad(mlp(x).square().sum(), params)
    places = _Places(mlp, params)
    with places.fresh() as leaves:
        assert not any(leaf is p for leaf, p in zip(leaves, params))
        out = mlp(x)
    got = torch.autograd.grad(out.square().sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert places.names[0].endswith("lora_A.default.weight")
    with pytest.raises(RuntimeError, match="inside"), places.fresh():
        raise RuntimeError("inside")
    assert [p for p in mlp.parameters() if p.requires_grad] == params
    assert all(p.grad is None for p in params)

    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    shared = list(tied.parameters())
    with _Places(tied, shared).fresh() as leaves:
        assert tied[0].weight is tied[1].weight is leaves[0]
    assert tied[0].weight is tied[1].weight is shared[0]

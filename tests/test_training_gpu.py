"""Graphs, allocator control and the fused LM loss on a GPU (run by scripts/gpu-check)."""

import gc
import json
import logging
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from tiny_configs import cache_argument  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_kernel_policy")]


class LM(nn.Module):
    def __init__(self, vocab=1000, d=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                   nn.Linear(4 * d, d))  # fmt: skip
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _setup(seed=0):
    torch.manual_seed(seed)
    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"),
                            fused=True, capturable=True)  # fmt: skip
    return model, opt


def _batches(n, b=8, t=64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 1000, (b, t), generator=g), torch.randint(0, 1000, (b, t), generator=g))
            for _ in range(n)]  # fmt: skip


def _eager_losses(model, opt, data, autocast_dtype=None):
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):  # fmt: skip
            loss = lm_loss(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimized", [False, True])
def test_graphed_train_step_follows_the_eager_loss_curve(optimized):
    data = _batches(6)
    model, opt = _setup()
    expected = _eager_losses(model, opt, data, torch.bfloat16)
    model, opt = _setup()
    if optimized:
        xpt.optimize(model, {"kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"}})
    step = xpt.make_graphed_train_step(model, lm_loss, opt, data[0], autocast_dtype=torch.bfloat16)
    got = [step(batch).item() for batch in data]
    # The first step is the model's first step: warm-up left no trace.
    assert got == pytest.approx(expected, abs=3e-2), (got, expected)
    assert got[-1] < got[0]


@pytest.mark.parametrize("optimized", [False, True])
def test_graphed_train_step_writes_the_same_gradients_and_weights_as_eager_steps(optimized):
    # fp32, so that a graph replaying the eager kernels matches them closely; Adam's
    # normalised updates would hide wrong gradients in a loss curve, not in the weights.
    data = _batches(3)
    reference, ref_opt = _setup()
    _eager_losses(reference, ref_opt, data)
    model, opt = _setup()
    if optimized:
        xpt.optimize(model, {"kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"}})
    step = xpt.make_graphed_train_step(model, lm_loss, opt, data[0])
    # The step keeps what its graph uses: dropping our references and filling the
    # freed memory must not change what the replays compute.
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    filler = [torch.full((2**20,), 1e4, device="cuda") for _ in range(64)]
    for batch in data:
        step(batch)
    del filler
    atol = 2e-5 if optimized else 1e-6
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-3, msg=f"grad of {name}")
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=name)


def test_graphed_train_step_refuses_another_batch_shape_by_name():
    model, opt = _setup()
    data = _batches(1)
    step = xpt.make_graphed_train_step(model, lm_loss, opt, data[0])
    x, y = _batches(1, b=4)[0]
    with pytest.raises(xrt.InvalidInputError, match=r"\(4, 64\).*captured for \(8, 64\)"):
        step((x, y))


def test_graphed_train_step_asks_for_a_capturable_optimizer():
    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(xrt.InvalidInputError, match="capturable=True"):
        xpt.make_graphed_train_step(model, lm_loss, opt, _batches(1)[0])


def test_a_host_sync_in_the_captured_step_is_refused_with_the_op_name():
    model, opt = _setup()

    def loss_with_sync(logits, targets):
        loss = lm_loss(logits, targets)
        if loss.item() > 1e9:  # a host read inside the step
            raise RuntimeError
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(xrt.UnsupportedOperationError, match="_local_scalar_dense"):
        xpt.make_graphed_train_step(model, loss_with_sync, opt, _batches(1)[0], warmup_steps=1)
    # The failed capture put the model back as it was.
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_a_cpu_tensor_in_a_captured_function_is_refused_with_the_op_name():
    cpu_scale = torch.ones(4)

    def fn(x):
        return x * 2 + (cpu_scale * 3).sum().cuda()

    with pytest.raises(xrt.UnsupportedOperationError, match=r"aten\.mul.*CPU tensor"):
        xpt.CUDAGraphWrapper(warmup_iters=1).capture(fn, torch.randn(4, device="cuda"))


def test_a_graphed_step_of_a_compiled_model_replays_the_compiled_kernels():
    # The capture checks run in the first warm-up step: under their dispatch mode,
    # compiled code runs uncompiled, so checking in the capture itself would record
    # PyTorch's unfused kernels instead of Inductor's.
    model, opt = _setup()
    step = xpt.make_graphed_train_step(torch.compile(model), lm_loss, opt, _batches(1)[0])
    with xpt.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(_batches(1)[0])
        torch.cuda.synchronize()
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any(name.startswith("triton_") for name in kernels), sorted(kernels)[:30]


def test_make_train_step_compiles_the_rewritten_model_so_both_fusions_run():
    data = _batches(4)
    policy = {"precision": "bf16", "cuda_graph": True,
              "kernels": {"layernorm": "fused", "linear_gelu": "fused"}}  # fmt: skip
    results = []
    for compile_model in (False, True):
        model, opt = _setup()
        step, report = xpt.make_train_step(
            model, lm_loss, opt, data[0], policy, compile_model=compile_model
        )
        assert report.fused_gelus == ["block.1"]
        with xpt.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            results.append([step(batch).item() for batch in data])
            torch.cuda.synchronize()
        kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        assert "_column_sums" in kernels  # our GELU-gradient pass, compiled or not
        assert any(k.startswith("triton_") for k in kernels) == compile_model  # Inductor's
        report.revert()
    assert results[1] == pytest.approx(results[0], rel=1e-3), results  # bf16, losses near 123


def test_graph_wrapper_replays_with_new_inputs_and_static_outputs():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
    graphed = xpt.CUDAGraphWrapper()
    with torch.no_grad():
        out = graphed.capture(model, torch.randn(16, 32, device="cuda"))
        for _ in range(3):
            x = torch.randn(16, 32, device="cuda")
            again = graphed.replay(x)
            assert again is out
            torch.testing.assert_close(again, model(x))
    with pytest.raises(xrt.InvalidInputError, match="captured for"):
        graphed.replay(torch.randn(8, 32, device="cuda"))


def test_capture_graph_block_replays_its_work():
    x = torch.randn(1024, device="cuda")
    y = x * 2  # warm-up outside the capture
    with xpt.capture_graph() as graph:
        y = x * 2 + 1
    x.copy_(torch.arange(1024.0, device="cuda"))
    graph.replay()
    torch.testing.assert_close(y, torch.arange(1024.0, device="cuda") * 2 + 1)
    assert graph.captured and graph.pool is not None


def test_fused_lm_loss_at_gpt2_scale_matches_pytorch_and_saves_memory():
    torch.manual_seed(0)
    x = torch.randn(8192, 768, device="cuda", requires_grad=True)
    w = (torch.randn(50304, 768, device="cuda") * 0.02).requires_grad_()
    t = torch.randint(0, 50304, (8192,), device="cuda")

    def peak(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return (
            loss.detach(),
            x.grad.clone(),
            w.grad.clone(),
            torch.cuda.max_memory_allocated() - base,
        )

    ours = peak(lambda: xpt.ops.fused_linear_cross_entropy(x, w, t))
    ref = peak(lambda: F.cross_entropy(F.linear(x, w), t))
    torch.testing.assert_close(ours[0], ref[0].float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-4, rtol=5e-2)
    torch.testing.assert_close(ours[2], ref[2], atol=1e-4, rtol=5e-2)
    assert ours[3] < 0.5 * ref[3], (ours[3], ref[3])


def test_allocator_stats_describe_the_cache():
    xpt.set_allocator("expandable_segments")
    try:
        blocks = [torch.empty(2**20 * (i + 1), device="cuda", dtype=torch.uint8) for i in range(8)]
        del blocks[::2]
        stats = xpt.allocator_stats()
        assert stats.kind == "expandable_segments"
        assert xpt.allocator_stats("cuda").segments == stats.segments > 0
        assert stats.reserved >= stats.allocated > 0
        assert stats.free_in_reserved == stats.reserved - stats.allocated
        assert (
            stats.largest_free_block is not None
            and stats.largest_free_block <= stats.free_in_reserved
        )
        assert 0.0 <= stats.fragmentation <= 1.0
    finally:
        xpt.reset_allocator()
    assert xpt.allocator_stats().kind == "default"


def test_memory_pool_keeps_a_blocks_tensors_apart():
    with xpt.memory_pool() as pool:
        t = torch.empty(3 * 2**20, device="cuda", dtype=torch.uint8)
    segments = pool.snapshot()
    assert any(
        b["state"] == "active_allocated" and b["size"] >= 3 * 2**20
        for s in segments for b in s["blocks"]
    ), segments  # fmt: skip
    del t


CHILD = """
import json, torch
import xpuruntime.pytorch as xpt
xpt.set_allocator("cuda_malloc_async")
x = torch.ones(2**20, device="cuda")
s = xpt.allocator_stats()
try:
    xpt.set_allocator("expandable_segments"); refused = None
except Exception as e:
    refused = type(e).__name__
print(json.dumps({"kind": s.kind, "allocated": s.allocated, "refused": refused}))
"""


def test_cuda_malloc_async_is_chosen_by_the_environment_before_torch_loads():
    env = dict(os.environ, PYTORCH_ALLOC_CONF="backend:cudaMallocAsync",
               PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kind"] == "cuda_malloc_async" and result["allocated"] >= 4 * 2**20
    assert result["refused"] == "UnsupportedOperationError"


def test_make_train_step_builds_the_graphed_step_a_policy_file_describes(tmp_path):
    data = _batches(4)
    model, opt = _setup()
    expected = _eager_losses(model, opt, data, torch.bfloat16)
    path = xrt.KernelPolicy(precision="bf16", cuda_graph=True, layernorm="fused",
                            cross_entropy="fused_linear").save(tmp_path / "step.json")  # fmt: skip
    model, opt = _setup()
    step, report = xpt.make_train_step(model, lm_loss, opt, data[0], path)
    assert isinstance(step, xpt.GraphedTrainStep)
    assert ("lm_head", "Linear (named lm_head)", "LinearCrossEntropyHead") in report.replaced
    got = [step(batch).item() for batch in data]
    assert got == pytest.approx(expected, abs=3e-2), (got, expected)


def test_auto_times_the_kernels_of_a_graphed_step_as_graph_replays():
    from xpuruntime.pytorch._functional._norms import _layer_norm

    data = _batches(2)
    model, opt = _setup()
    policy = {"precision": "bf16", "cuda_graph": True, "auto_strategy": "best_performance",
              "kernels": {"layernorm": "auto"}}  # fmt: skip
    step, report = xpt.make_train_step(model, lm_loss, opt, data[0], policy)
    decisions = list(_layer_norm.decisions.values())
    assert decisions and all(set(d.measurements) == {"fused", "torch"} for d in decisions)
    assert all(d.reason.endswith("(as CUDA-graph replays)") for d in decisions), decisions
    assert torch.isfinite(step(data[1]))
    report.revert()


def test_an_eager_step_keeps_the_faster_kernel_ranking_and_undoes_its_trial_steps(caplog):
    caplog.set_level(logging.INFO, logger="xpuruntime.pytorch.graphs")
    data = _batches(3)
    model, opt = _setup()
    expected = _eager_losses(model, opt, data)
    model, opt = _setup()
    policy = {"precision": "fp32", "auto_strategy": "best_performance",
              "kernels": {"layernorm": "auto", "linear": "auto"}}  # fmt: skip
    step, report = xpt.make_train_step(model, lm_loss, opt, data[0], policy)
    assert isinstance(step, xpt.TrainStep) and step.kernels_by_gpu_time is None
    got = [step(batch).item() for batch in data]  # sixteen trial steps first, undone
    assert isinstance(step.kernels_by_gpu_time, bool)
    assert got == pytest.approx(expected, abs=2e-3), (got, expected)
    said = [r.getMessage() for r in caplog.records if "kernels ranked by" in r.msg]
    assert len(said) == 1 and "ms per step by GPU time" in said[0], said
    report.revert()


def test_a_trial_step_that_fails_leaves_the_model_as_it_was_and_the_next_call_trains():
    data = _batches(2)
    model, opt = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def flaky_loss(logits, targets):
        calls.append(1)
        if len(calls) == 3:  # inside the trial steps
            raise RuntimeError("a loss that fails once")
        return lm_loss(logits, targets)

    policy = {"precision": "fp32", "auto_strategy": "best_performance",
              "kernels": {"layernorm": "auto"}}  # fmt: skip
    step, report = xpt.make_train_step(model, flaky_loss, opt, data[0], policy)
    with pytest.raises(RuntimeError, match="fails once"):
        step(data[0])
    assert step.kernels_by_gpu_time is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.isfinite(step(data[1])) and isinstance(step.kernels_by_gpu_time, bool)
    report.revert()


def test_a_replayed_timing_runs_the_backward_and_leaves_no_gradient_behind():
    from xpuruntime.pytorch._selection._timing import time_training_call

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    seconds = time_training_call(lambda: x @ w, [x, w], x.device, backward=True, replayed=True)
    assert 0 < seconds < 1e-2 and x.grad is None and w.grad is None


def test_graphed_train_step_clips_gradients_on_the_device_like_eager_clipping():
    data = _batches(3)
    reference, ref_opt = _setup()
    for x, y in data:
        ref_opt.zero_grad(set_to_none=True)
        lm_loss(reference(x.cuda()), y.cuda()).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1) > 0.1
        ref_opt.step()
    model, opt = _setup()
    step = xpt.make_graphed_train_step(model, lm_loss, opt, data[0], max_grad_norm=0.1)
    for batch in data:
        step(batch)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-4, msg=name)


def test_without_restore_the_warm_up_steps_are_training_steps():
    model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    xpt.make_graphed_train_step(model, lm_loss, opt, _batches(1)[0], restore_state=False)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    model, opt = _setup()
    xpt.make_graphed_train_step(model, lm_loss, opt, _batches(1)[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_fp16_graphed_step_scales_the_loss_on_the_device_like_the_eager_step():
    # Same kernels both ways (the policy's), eager with torch.amp.GradScaler against the
    # graph; the model is re-initialised to GPT-2's scale so that fp16 is well-conditioned.
    data = _batches(6)
    policy = {
        "precision": "fp16",
        "kernels": {"layernorm": "fused", "cross_entropy": "fused_linear"},
    }
    results = []
    for graph in (False, True):
        model, opt = _setup()
        torch.nn.init.normal_(model.wte.weight, std=0.02)
        step, report = xpt.make_train_step(
            model, lm_loss, opt, data[0], dict(policy, cuda_graph=graph)
        )
        gc.collect()  # nothing the graph uses may depend on references held here
        results.append(([step(batch).item() for batch in data], step.grad_scaler.get_scale()))
        report.revert()
    (eager, eager_scale), (graphed, graphed_scale) = results
    assert graphed == pytest.approx(eager, abs=1e-2), (graphed, eager)
    assert graphed_scale == eager_scale
    assert graphed[-1] < graphed[0]


def test_a_grad_scaler_needs_an_optimizer_that_applies_the_scale_on_the_device():
    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), capturable=True)  # not fused
    with pytest.raises(xrt.InvalidInputError, match="fused=True"):
        xpt.make_graphed_train_step(model, lm_loss, opt, _batches(1)[0],
                                    grad_scaler=torch.amp.GradScaler("cuda"))  # fmt: skip


def test_a_graphed_lora_step_of_a_transformers_llama_trains_from_its_own_labels_loss():
    # What a LoRA user's loop hands in: a mapping batch, the model's own loss from
    # ``labels`` (its head fused into the loss by optimize), peft adapters over a bf16 base.
    ids = [torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(i)).cuda()
           for i in range(4)]  # fmt: skip
    results = []
    for graph in (False, True):
        model, trained = _bf16_peft_llama()
        opt = torch.optim.AdamW(trained, lr=1e-2, fused=True, capturable=graph)
        step, report = xpt.make_train_step(
            model, lambda out, _: out.loss, opt, {"input_ids": ids[0], "labels": ids[0]},
            {"precision": "bf16", "cuda_graph": graph},
        )  # fmt: skip
        assert isinstance(step, xpt.GraphedTrainStep) == graph
        results.append([step({"input_ids": x, "labels": x}).item() for x in ids * 2])
        report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, abs=2e-2), (graphed, eager)
    assert graphed[-1] < graphed[0]


@pytest.mark.parametrize("attention", ["auto", "cudnn"])
def test_under_packed_sequences_a_graphed_step_captures_packed_rows_and_trains_as_eager(
    attention,
):
    # TRL's padding-free rows, packed differently in each batch: the documents are made
    # from the positions inside the graph (cuDNN gets the mask made from them). Without
    # packed_sequences transformers reads the positions on the host in every forward,
    # which a capture cannot hold.
    packings = ((128, 64, 64, 256), (512,), (32,) * 16, (300, 200, 12))
    batches = []
    for i, lengths in enumerate(packings):
        ids = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(i))
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[positions == 0] = -100  # no target across a document's start
        batches.append({"input_ids": ids.cuda(), "labels": labels.cuda(),
                        "position_ids": positions.cuda()})  # fmt: skip
    model, trained = _bf16_peft_llama()
    opt = torch.optim.AdamW(trained, lr=1e-2, fused=True, capturable=True)
    with pytest.raises(xrt.UnsupportedOperationError, match="packed_sequences makes their"):
        xpt.make_train_step(model, lambda out, _: out.loss, opt, batches[0],
                            {"precision": "bf16", "cuda_graph": True})  # fmt: skip
    results = []
    for graph in (False, True):
        model, trained = _bf16_peft_llama()
        opt = torch.optim.AdamW(trained, lr=1e-2, fused=True, capturable=graph)
        step, report = xpt.make_train_step(
            model, lambda out, _: out.loss, opt, batches[0],
            {"precision": "bf16", "cuda_graph": graph, "packed_sequences": True,
             "kernels": {"attention": attention}},
        )  # fmt: skip
        assert isinstance(step, xpt.GraphedTrainStep) == graph
        assert report.packed_positions_read_on_device == ["base_model.model.model"]
        results.append([step(batch).item() for batch in batches * 2])
        report.revert()
    eager, graphed = results
    assert graphed == pytest.approx(eager, abs=2e-2), (graphed, eager)
    assert graphed[-1] < graphed[-len(batches) - 1]


def _bf16_peft_llama():
    """A small transformers Llama in bf16 (no cache) under peft LoRA r=8 on every linear
    layer, seeded alike each call: the model and its trained parameters."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = peft.get_peft_model(model, lora)
    return model, [p for p in model.parameters() if p.requires_grad]


def test_while_a_graph_is_captured_a_plain_causal_mask_is_left_to_sdpa_and_any_other_is_built():
    # transformers builds the whole (B, 1, T, T) mask while a stream captures (it cannot
    # read the tensors there): cuDNN's attention then took 30.6 ms of a graphed Llama-1B
    # LoRA step against 11.1 without it.
    transformers = pytest.importorskip("transformers")
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache

    from xpuruntime.pytorch._optimize.patterns.causal_mask import _mask_builder

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, vocab_size=64)
    config._attn_implementation = "sdpa"
    mask = _mask_builder(masking_utils.create_causal_mask)
    embeds = torch.randn(2, 12, 32, device="cuda")
    padded = torch.ones(2, 12, dtype=torch.long, device="cuda")
    padded[0, :3] = 0
    cache = cache_argument(masking_utils.create_causal_mask)
    graph, made = torch.cuda.CUDAGraph(), {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for name, attention_mask in (("plain", None), ("padded", padded)):
            made[name] = mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                              position_ids=None, **{cache: DynamicCache(config=config)})  # fmt: skip
    assert made["plain"] is None
    assert isinstance(made["padded"], torch.Tensor) and made["padded"].dim() == 4

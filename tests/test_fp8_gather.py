"""Trained weights FSDP2 gathers in FP8 (``xpt.distributed.shard``'s ``fp8_gather``):
on one rank in this process (gloo on the CPU, NCCL on a GPU), a transformers Llama under ``precision="fp8"``
trains as with bf16 gathers, its joined GEMMs' weights share one amax, a step's write
finds the amaxes again once, and what the model and optimizer save is plain. Two ranks
against one process: tests/test_distributed.py (tests/jobs/fp8_ranks.py)."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_configs import SMALL  # noqa: E402

# On a GPU (whose Triton kernels do not run on CPU tensors) one NCCL rank on it; with
# plain matmul attention, whose backward is deterministic there too.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def one_rank(monkeypatch):
    from xpuruntime.pytorch._kernels import fp8

    if DEVICE == "cpu":
        monkeypatch.setattr(fp8, "fp8_refusal", lambda device: None)
    elif fp8.fp8_refusal(torch.device(DEVICE)) is not None:
        pytest.skip(fp8.fp8_refusal(torch.device(DEVICE)))
    monkeypatch.setattr(fp8, "FP8_MIN_TOKENS", 0)
    monkeypatch.setattr(fp8, "FP8_MIN_WEIGHT", 0)
    store = torch.distributed.HashStore()
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, dtype)


def _steps(model, steps=2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(step))
        ids = ids.to(DEVICE)
        with torch.autocast(DEVICE, torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, optimizer


def _locals(model):
    from xpuruntime.pytorch.distributed._fp8_gathers import Fp8Shard

    return {name: p._local_tensor for name, p in model.named_parameters()
            if isinstance(p._local_tensor, Fp8Shard)}  # fmt: skip


@contextlib.contextmanager
def _sharded(dtype=torch.float32, checkpointing=False, **shard):
    """A tiny Llama optimized under ``precision="fp8"`` and sharded on the one rank; its
    policy cleared after (a sharded model is not reverted)."""
    model = _llama(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    xpt.optimize(model, {"precision": "fp8"})
    try:
        xpt.distributed.shard(model, **shard)
        yield model
    finally:
        xpt.clear_kernel_policy()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_llama_gathered_in_fp8_trains_bit_for_bit_as_with_bf16_gathers(checkpointing):
    # bf16 parameters: both paths cast the same bf16 values by the same amax, so the
    # GEMMs read the same bytes; one cast before the gather, the other after it. Under
    # gradient checkpointing the backward gathers each layer again for its recompute.
    runs = []
    for gather in (True, False):
        with _sharded(torch.bfloat16, checkpointing, fp8_gather=gather) as model:
            assert len(_locals(model)) == (14 if gather else 0)  # 2 layers of 7
            runs.append(_steps(model))
    (losses, grads, _), (want_losses, want_grads, _) = runs
    assert losses == want_losses
    for step, want_step in zip(grads, want_grads):
        for grad, want in zip(step, want_step):
            torch.testing.assert_close(grad, want, rtol=0, atol=0)


@pytest.mark.usefixtures("one_rank")
def test_a_joined_gemms_weights_share_the_amax_found_once_a_layer_after_each_step():
    from xpuruntime.pytorch.distributed import _fp8_gathers

    with _sharded() as model:
        shards = _locals(model)
        prefix = "model.layers.0."
        qkv = [shards[f"{prefix}self_attn.{n}_proj.weight"] for n in "qkv"]
        gate_up = [shards[f"{prefix}mlp.{n}_proj.weight"] for n in ("gate", "up")]
        alone = shards[f"{prefix}self_attn.o_proj.weight"]
        assert len({s.group for s in qkv}) == len({s.group for s in gate_up}) == 1
        assert len({s.group for s in (qkv[0], gate_up[0], alone)}) == 3
        found = []
        refresh = _fp8_gathers.Scales._refresh
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_fp8_gathers.Scales, "_refresh", lambda s, unit, *rest:
                          found.append(unit) or refresh(s, unit, *rest))  # fmt: skip
            _steps(model, steps=2)
            assert found == [0, 1, 0, 1]  # each layer's once a step, at its first gather
            scales = qkv[0].scales
            most = max(float(s._tensor.abs().max()) for s in qkv)
            for s in qkv:  # (the step's write is seen: found again, by the new values)
                assert float(scales.amax(s, None)) == most
            assert found == [0, 1, 0, 1, 0]


@pytest.mark.usefixtures("one_rank")
def test_what_a_model_gathered_in_fp8_saves_loads_without_this_package():
    with _sharded() as model:
        _, _, optimizer = _steps(model, steps=1)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in model.state_dict().items()}  # fmt: skip
        assert {type(v) for v in state.values()} == {torch.Tensor}
        moments = [s["exp_avg"] for s in optimizer.state.values()]
        assert {type(m.to_local()) for m in moments} == {torch.Tensor}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        name = "model.layers.0.mlp.down_proj.weight"
        torch.testing.assert_close(loaded[name], model.get_parameter(name).full_tensor())
        # Loaded back in place: a write the next gather's amax sees.
        shard = _locals(model)[name]
        scales = shard.scales
        before = float(scales.amax(shard, None))
        model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
        torch.testing.assert_close(shard._tensor, loaded[name] * 2)
        assert float(scales.amax(shard, None)) == 2 * before


@pytest.mark.usefixtures("one_rank")
def test_fp8_gather_says_what_it_needs():
    model = _llama()
    report = xpt.optimize(model)  # no FP8 precision
    try:
        with pytest.raises(xrt.InvalidInputError, match="fp8_gather=True, but no.*'fp8'"):
            xpt.distributed.shard(model, fp8_gather=True)
        with pytest.raises(xrt.InvalidInputError, match="fp8_gather must be True, False"):
            xpt.distributed.shard(model, fp8_gather="yes")
    finally:
        report.revert()


@pytest.mark.usefixtures("one_rank")
def test_a_model_gathered_in_fp8_trains_under_torch_compile_as_it_runs_eagerly():
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        with _sharded() as model:
            assert len(_locals(model)) == 14
            runs.append(_steps(torch.compile(model) if compiled else model)[0])
    eager, compiled = runs
    assert compiled == pytest.approx(eager, rel=1e-3)

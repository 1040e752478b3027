"""The kernel policy under torch.distributed: two real processes on gloo (torchrun), the
same decisions and the single-process losses, a differing policy refused on both ranks,
and the ranks' logs on rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import xpuruntime as xrt  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
FAILING_RANK = Path(__file__).resolve().parent / "jobs" / "failing_rank.py"
LORA_RANKS = Path(__file__).resolve().parent / "jobs" / "lora_ranks.py"
FP8_RANKS = Path(__file__).resolve().parent / "jobs" / "fp8_ranks.py"
EMBEDDING_ROWS = Path(__file__).resolve().parent / "jobs" / "embedding_rows.py"
BUCKET_GRADIENTS = Path(__file__).resolve().parent / "jobs" / "bucket_gradients.py"
OPTIMIZER_SHARDS = Path(__file__).resolve().parent / "jobs" / "optimizer_shards.py"
COMPILED_DDP = Path(__file__).resolve().parent / "jobs" / "compiled_ddp.py"


def _run(*args: str, torchrun: bool = True, ranks: int = 2) -> list[dict]:
    command = [sys.executable]
    if torchrun:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    # Without the Triton interpreter the fused candidates are refused on the CPU and
    # PyTorch's kernels run: seconds instead of minutes, the same collectives.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [*command, str(EXAMPLE), *args], capture_output=True, text=True, timeout=240, env=env
    )
    lines = _objects(done.stdout)
    assert lines, f"rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return lines


def _two_ranks(job: Path, *args: str) -> list[dict]:
    """Each rank's JSON object from ``job`` run by torchrun on two ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    done = subprocess.run(
        [*command, "2", str(job), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = _objects(done.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1]
    return results


def _objects(text: str) -> list[dict]:
    """The JSON objects in ``text`` (the ranks print to one pipe: they may share a line)."""
    found, decoder, at = [], json.JSONDecoder(), 0
    while (at := text.find("{", at)) != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        found.append(value)
        at = end
    return found


@pytest.mark.parametrize("strategy", ["first_supported", "best_performance"])
def test_two_ranks_make_the_same_decisions_and_match_one_process(strategy):
    (result,) = _run("--steps", "4", "--strategy", strategy)
    (reference,) = _run("--single", "--steps", "4", "--strategy", strategy, torchrun=False)
    assert result["ranks"] == [0, 1]  # both ranks' records gathered on rank 0
    assert result["decisions"]["0"] == result["decisions"]["1"]
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-4)
    if strategy == "best_performance":  # rank 1 took rank 0's measured choices
        assert result["taken_from_rank_0"].get("1", 0) > 0
        assert "0" not in result["taken_from_rank_0"]


def test_a_different_policy_on_one_rank_is_refused_on_both():
    results = _run("--steps", "2", "--policy-from-rank")
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert "rank 1: layernorm='torch' (rank 0: 'auto')" in r["policy_error"]


def test_init_distributed_outside_torchrun_says_what_is_missing(monkeypatch):
    from xpuruntime.pytorch import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(xrt.InvalidInputError, match="torchrun"):
        distributed.init_distributed()
    assert not distributed.is_initialized()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    distributed.check_policy(xrt.KernelPolicy())  # no-op outside a job
    distributed.barrier()


def test_gradient_accumulation_under_ddp_matches_one_process():
    (result,) = _run("--steps", "3", "--accumulate", "2")
    (reference,) = _run("--single", "--steps", "3", torchrun=False)
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-4)


@pytest.mark.parametrize("how", ["--static-graph", "--find-unused"])
def test_a_ddp_model_with_a_fused_loss_matches_one_process_however_ddp_holds_its_outputs(how):
    # DDP clones the outputs on a static graph's first step and under
    # find_unused_parameters, whose walk from the outputs must find every parameter: the
    # deferred logits pass through (no materialising), and DDP's backward work runs.
    (result,) = _run("--steps", "3", how)
    (reference,) = _run("--single", "--steps", "3", torchrun=False)
    assert result["decisions"]["0"]["cross_entropy"] != ["torch"]
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-4)


def _lora_against_one_process(
    ranks: list[str], alone: list[str] | None = None
) -> tuple[dict, dict, str]:
    """``tests/jobs/lora_ranks.py`` on two ranks with the arguments ``ranks``, and alone
    (``single`` with ``alone``): rank 0's result, the single process's, and the ranks'
    stderr. Without ``--cuda``: on the CPU under Triton's interpreter (the fused kernels
    run there)."""
    env = {**os.environ}
    if "--cuda" not in ranks:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    done = subprocess.run([*command, "2", str(LORA_RANKS), *ranks], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    single = subprocess.run([sys.executable, str(LORA_RANKS), "single", *(alone or [])],
                            capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    (result,), (reference,) = _objects(done.stdout), _objects(single.stdout)
    return result, reference, done.stderr


@pytest.mark.parametrize("how", ["ddp", "data-parallel", "fsdp2", "shard", "shard-replicated"])
def test_a_peft_lora_model_optimized_then_spread_trains_as_one_process(how):
    # Llama with LoRA on every linear layer, the adapters fused; FSDP2 shards the frozen
    # base with them. The fused head's logits stay deferred through FSDP2's output hooks.
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    result, reference, said = _lora_against_one_process([how])
    assert "fused 14 LoRA layer(s)" in result["report"]
    assert "materialised" not in said
    exact = how != "shard"  # (shard: in bf16, whose gradients here are 10-20% apart)
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-5 if exact else 2e-2)
    if exact:
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    if how in ("shard-replicated", "data-parallel"):  # adapters whole on each rank, alike
        assert result["whole"] == result["trained"] > 0
        assert result["spread"] == 0.0
    if how == "data-parallel":  # the model itself, no DDP around it
        assert result["wrapped"] == "PeftModel"
    elif how not in ("ddp", "shard-replicated"):
        assert result["whole"] == 0


def test_replicated_adapters_accumulated_over_micro_batches_train_as_one_process():
    # Without DDP's no_sync each micro-batch's gradients are averaged as they come: the
    # same sum, as the one-process step over the whole global batch.
    pytest.importorskip("peft")
    result, reference, _ = _lora_against_one_process(["data-parallel", "--accumulate", "2"])
    assert result["wrapped"] == "PeftModel" and result["spread"] == 0.0
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-5)


def _lora_ranks_runs(hows: tuple[str, ...], *flags: str) -> dict:
    """The LoRA job run each way of ``hows`` (two ranks; ``single``: one process) with
    ``flags``, under Triton's interpreter: each run's finished process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    return {
        how: subprocess.run(
            [*command, "2", str(LORA_RANKS), how, *flags] if how != "single"
            else [sys.executable, str(LORA_RANKS), how, *flags],
            capture_output=True, text=True, timeout=600, env=env,
        )
        for how in hows
    }  # fmt: skip


def test_lora_over_fp8_stored_bases_trains_under_ddp_and_fsdp2_as_one_process():
    # fp8_base (PyTorch's _scaled_mm on the CPU, the device check set aside in the job):
    # DDP's broadcast of the module states meets the FP8-stored weights; FSDP2 (by hand,
    # and by xpt.distributed.shard in bf16) keeps each rank's rows of a stored weight in
    # FP8 and gathers them as FP8. The ranks' losses are the single process's.
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    runs = _lora_ranks_runs(("ddp", "single", "fsdp2", "shard"), "--fp8-base")
    (reference,) = _objects(runs["single"].stdout)
    for how, tolerance in (("ddp", 1e-3), ("fsdp2", 1e-3), ("shard", 2e-3)):  # shard: bf16
        assert runs[how].returncode == 0, runs[how].stderr[-3000:]
        (result,) = _objects(runs[how].stdout)
        assert "stored 14 frozen LoRA base weight(s) in FP8" in result["report"]
        for ours, theirs in zip(result["losses"], reference["losses"]):
            assert ours == pytest.approx(theirs, rel=tolerance), how
        if how != "ddp":  # rank 0's half of every stored base's rows, gathered in FP8
            assert result["fp8_shards"] == 14 and result["gathered"] == ["Fp8Weight"]
            assert 2 * result["fp8_shard_rows"] == reference["stored_rows"]


@pytest.mark.parametrize("precision", ["--qlora", "--qlora-fp8"], ids=["bf16", "fp8"])
def test_qlora_spread_by_ddp_or_data_parallel_trains_as_one_process(precision):
    # peft over bitsandbytes nf4 layers (QLoRA): DDP broadcasts the 4-bit bytes with the
    # other states; data_parallel keeps the adapters whole and averages them. Under FP8
    # every group's 4-bit base is made FP8 on each call on each rank.
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    runs = _lora_ranks_runs(("ddp", "data-parallel", "single"), precision)
    (reference,) = _objects(runs["single"].stdout)
    chosen = ["fp8"] if precision == "--qlora-fp8" else ["fused"]
    assert reference["chosen"] == chosen
    for how in ("ddp", "data-parallel"):
        assert runs[how].returncode == 0, runs[how].stderr[-3000:]
        (result,) = _objects(runs[how].stdout)
        assert result["chosen"] == chosen and "fused 14 LoRA layer(s)" in result["report"]
        assert result["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5)
        # (later steps: bf16 autocast rounds each rank's half of the batch apart)
        assert result["losses"] == pytest.approx(reference["losses"], rel=2e-3), how
        if how == "data-parallel":
            assert result["spread"] == 0.0


@pytest.mark.parametrize("how", ["data-parallel", "fsdp2"])
def test_gate_and_up_kept_in_fp8_train_spread_as_one_process(how):
    # fp8_activations over stored bases (the 8B LoRA goal's configuration) on two gloo
    # ranks, the adapters kept whole by data_parallel (DDP's broadcast of stored bases is
    # the test above's), or FSDP2 gathering the stored bases' rows (the MLP's projections
    # handed their casts by the activation there too): the ranks' losses are the single
    # process's.
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    flags = ["--fp8-base", "--fp8-activations"]
    result, reference, _ = _lora_against_one_process([how, *flags], flags)
    assert "kept 2 gated activations' gate and up in FP8" in result["report"]
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-3)


def test_a_model_training_in_fp8_trains_sharded_by_fsdp2_as_one_process():
    # precision fp8 (every linear layer's GEMMs FP8, PyTorch's _scaled_mm on gloo's CPU
    # ranks), then xpt.distributed.shard: each rank casts its shards of the trained
    # weights to e4m3 by their amax over both ranks, and FSDP2 gathers those bytes.
    # Tensorwise, each rank scales its input by its own rows' amax, and the weights are
    # cast from fp32, not from bf16: the losses are near the single process's.
    pytest.importorskip("transformers")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    sharded = subprocess.run([*command, "2", str(FP8_RANKS), "shard"], capture_output=True,
                             text=True, timeout=600, env=env)  # fmt: skip
    alone = subprocess.run([sys.executable, str(FP8_RANKS), "single"], capture_output=True,
                           text=True, timeout=600, env=env)  # fmt: skip
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    (result,), (reference,) = _objects(sharded.stdout), _objects(alone.stdout)
    assert result["chosen"] == reference["chosen"] == ["fp8"]
    assert result["gathered_in_fp8"] == 14 and reference["gathered_in_fp8"] == 0
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-2)


def test_shard_refuses_a_stored_weight_whose_rows_the_ranks_cannot_share():
    from xpuruntime.pytorch._ops._infra._fp8_weight import store_fp8
    from xpuruntime.pytorch.distributed._fsdp import _check_stored_rows

    model = torch.nn.Linear(8, 6, bias=False).requires_grad_(False)
    (model.weight,) = store_fp8([model.weight])
    assert _check_stored_rows(model, 2) == 1  # 6 rows: 3 each
    with pytest.raises(xrt.InvalidInputError, match="weight is stored in FP8.*6 rows.*4 ranks"):
        _check_stored_rows(model, 4)


def test_shard_refuses_a_quantized_base_and_names_data_parallel():
    # QLoRA's 4-bit base: FSDP2's shards would lose its quantization state (bitsandbytes
    # then fails in the first forward, far from the cause).
    bnb = pytest.importorskip("bitsandbytes")
    from xpuruntime.pytorch.distributed._fsdp import _refuse_quantized

    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4"))
    with pytest.raises(xrt.UnsupportedOperationError, match="0.weight is a bitsandbytes "
                       "Params4bit.*data_parallel"):  # fmt: skip
        _refuse_quantized(model)
    _refuse_quantized(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # plain weights: nothing


def test_shard_says_what_it_needs():
    from xpuruntime.pytorch import distributed
    from xpuruntime.pytorch.distributed._fsdp import _repeated_blocks, _reshard_after_forward

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(xrt.InvalidInputError, match="no process group"):
        distributed.shard(model)
    with pytest.raises(xrt.InvalidInputError, match="True, False or None.*'yes'"):
        distributed.shard(model, reshard_after_forward="yes")
    with pytest.raises(xrt.InvalidInputError, match="replicate_trained.*True, False or None.*'no'"):
        distributed.shard(model, replicate_trained="no")
    assert _reshard_after_forward(list(model), torch.bfloat16, set())  # CPU: resharded
    assert _repeated_blocks(model) == []  # the Sequential's one Linear: no list
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])
    holder = torch.nn.ModuleDict({"blocks": blocks, "mixed": mixed})
    assert _repeated_blocks(holder) == list(blocks)


class _TwoFactors(torch.nn.Module):
    """``x a b``, squared and summed, and a parameter it reads only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = (
            torch.nn.Parameter(torch.randn(8, 4)),
            torch.nn.Parameter(torch.randn(4, 2)),
        )
        self.c = torch.nn.Parameter(torch.randn(2))

    def forward(self, x, with_c=True, reentrant=False):
        def tail(h):
            y = h @ self.b
            return (y * self.c if with_c else y).square().sum()

        h = x @ self.a  # reentrant: b's and c's gradients in a backward of their own
        return (
            torch.utils.checkpoint.checkpoint(tail, h, use_reentrant=True) if reentrant else tail(h)
        )


def test_replicated_gradients_fill_their_buckets_across_reentrant_backwards_and_refuse_one_left_out(
    monkeypatch,
):
    from xpuruntime.pytorch.distributed import _replicated

    monkeypatch.setattr(_replicated, "BUCKET_BYTES", 4)  # a bucket each
    torch.manual_seed(0)
    model, x = _TwoFactors(), torch.randn(5, 8)
    want = torch.autograd.grad(model(x), list(model.parameters()))
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)  # fmt: skip
    try:
        replicated = _replicated.ReplicatedGradients(model, "shard")
        assert [len(bucket.params) for bucket in replicated.buckets] == [1, 1, 1]
        for step in (1, 2):  # the second accumulates into the buckets' views
            model(x).backward()
            for p, g in zip(model.parameters(), want):
                torch.testing.assert_close(p.grad, step * g)
        views = {bucket.buffer.data_ptr() for bucket in replicated.buckets}
        assert {p.grad.data_ptr() for p in model.parameters()} == views
        model.zero_grad(set_to_none=True)  # copied in again
        model(x).backward()
        torch.testing.assert_close(model.a.grad, want[0])
        assert model.a.grad.data_ptr() in views
        model.zero_grad(set_to_none=True)
        model(x, with_c=False).backward()  # c got no gradient: not averaged
        with pytest.raises(
            xrt.UnsupportedOperationError, match=r"1 trained.*\['c'\].*replicate_trained=False"
        ):
            model(x)
        model(x).backward()  # started over
        torch.testing.assert_close(model.c.grad, want[2])
        model.zero_grad(set_to_none=True)
        model(x, reentrant=True).backward()  # its buckets filled over two backwards
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g)
        model(x)  # nothing left out
    finally:
        torch.distributed.destroy_process_group()


def test_shard_counts_a_weight_stored_in_fp8_at_the_bytes_it_gathers():
    # Whether the blocks stay gathered is decided from what they gather: a stored FP8
    # weight moves a byte a parameter and its rows' scales, not bf16's two.
    from xpuruntime.pytorch._ops._infra._fp8_weight import store_fp8
    from xpuruntime.pytorch.distributed._fsdp import gathered_bytes

    dense = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    (stored,) = store_fp8([torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)])
    assert gathered_bytes([dense], torch.bfloat16) == 64 * 32 * 2
    assert gathered_bytes([dense], None) == 64 * 32 * 4
    assert gathered_bytes([stored], torch.bfloat16) == 64 * 32 + 64 * 4


@pytest.mark.parametrize(
    "family, plain", [("llama", False), ("gemma3_text", False), ("llama", True)]
)
def test_a_tied_embeddings_gradient_exchanged_as_rows_equals_ddps_whole_reduction(family, plain):
    # Ranks of different batch shapes, the padding id among the tokens, a no_sync
    # micro-batch, then compiled (the lookup as written); Gemma3's lookup is a subclass;
    # plain: no static graph, gradients copied from the buckets.
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    done = subprocess.run(
        [*command, "2", str(EMBEDDING_ROWS), family, *(["--plain"] if plain else [])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = _objects(done.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["exchanged"] and result["eval_equal"]
        plain, accumulated, compiled = result["differences"]
        assert plain < 1e-5 and accumulated < 1e-5  # fp32, the terms in another order
        assert compiled == 0.0


def test_fsdp2_steps_match_one_process():
    (result,) = _run("--steps", "3", "--fsdp")
    (reference,) = _run("--single", "--steps", "3", torchrun=False)
    assert result["decisions"]["0"] == result["decisions"]["1"]
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-4)


def test_accumulation_splits_the_batch_and_steps_once():
    from xpuruntime import pytorch as xpt

    def run(steps: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        step, report = xpt.make_train_step(
            model, torch.nn.functional.cross_entropy, opt, (x, y), accumulation_steps=steps
        )
        step((x, y))
        report.revert()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(1), run(4)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(xrt.InvalidInputError, match="divisible"):
        run(3)


def test_graphed_steps_ddp_cannot_capture_are_refused_with_the_reason():
    from xpuruntime.pytorch._training._train_step import _check_graphable

    with pytest.raises(xrt.UnsupportedOperationError, match="eager step"):
        _check_graphable(torch.nn.Linear(2, 2), 2)


def test_a_graphed_step_of_a_ddp_model_built_by_hand_is_refused_naming_data_parallel():
    import torch.distributed as dist

    from xpuruntime.pytorch import distributed
    from xpuruntime.pytorch._training._train_step import _check_graphable

    with pytest.raises(xrt.InvalidInputError, match="init_distributed"):
        distributed.data_parallel(torch.nn.Linear(2, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        by_hand = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(2, 2), static_graph=True
        )
        with pytest.raises(xrt.UnsupportedOperationError, match="data_parallel"):
            _check_graphable(by_hand, 1)
        ours = distributed.data_parallel(torch.nn.Linear(2, 2))
        assert ours.static_graph and ours.gradient_as_bucket_view
        _check_graphable(ours, 1)
    finally:
        dist.destroy_process_group()


def test_the_gathered_logs_say_where_ranks_chose_differently():
    from xpuruntime.kernels import DispatchRecord
    from xpuruntime.pytorch.distributed import compare_ranks

    def record(rank, chosen):
        return DispatchRecord("attention", chosen, "auto", "", None, (), rank=rank)

    same = compare_ranks([record(0, "cudnn"), record(1, "cudnn")])
    assert same == "ranks [0, 1] chose the same kernels for every op in their logs"
    differ = compare_ranks([record(0, "cudnn"), record(1, "flash_v2")])
    assert differ == "the ranks chose different kernels: attention: rank 0 cudnn, rank 1 flash_v2"


@pytest.mark.parametrize(
    ("backend", "where", "tries", "how"),
    [
        ("gloo", "between", 1, "ddp"),
        ("gloo", "forward", 5, "ddp"),
        ("gloo", "backward", 5, "ddp"),
        ("gloo", "backward", 3, "replicated"),  # the others wait in our hooks' all-reduce
        pytest.param("nccl", "forward", 4, "ddp", marks=pytest.mark.gpus2),  # 10 tries
        pytest.param("nccl", "backward", 3, "ddp", marks=pytest.mark.gpus2),
        pytest.param("nccl", "oom", 3, "ddp", marks=pytest.mark.gpus2),
    ],
)
def test_a_rank_that_fails_mid_step_ends_the_job_within_a_minute_with_its_error(
    backend, where, tries, how
):
    # The others wait in the step's all-reduce (their timeout: 600 s); torchrun ends them
    # once the failing rank exits, and names it with its traceback. Every try must. (Its
    # "root cause" is the failure it observed first: where the others' collective fails
    # in the same instant, a rank that did not raise may be named there, the failing
    # one among the failures listed with it.)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    error = (
        "OutOfMemoryError"
        if where == "oom"
        else "RuntimeError: rank 1 failed in step 2, as the test asked"
    )
    for _ in range(tries):
        start = time.monotonic()
        done = subprocess.run(
            [*command, "--nproc_per_node", "2", str(FAILING_RANK), "1", "2", backend, where, how],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        took = time.monotonic() - start
        assert done.returncode != 0 and took < 60, (took, done.stderr[-3000:])
        assert "finished" not in done.stdout
        summary = done.stderr.split(f"{FAILING_RANK.name} FAILED")[-1]
        failed = [block for block in summary.split("time      :")
                  if "rank      : 1 (local_rank: 1)" in block]  # fmt: skip
        assert failed, done.stderr[-3000:]
        assert error in failed[0], summary[-3000:]


@pytest.mark.gpus2
def test_a_graphed_ddp_step_on_two_gpus_trains_as_the_eager_step():
    # Forward, backward, DDP's all-reduce over NCCL and AdamW replayed as one graph.
    (graphed,) = _run("--steps", "4", "--graph")
    (eager,) = _run("--steps", "4", "--static-graph")
    assert graphed["decisions"]["0"] == graphed["decisions"]["1"]
    for ours, theirs in zip(graphed["losses"], eager["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-3)


@pytest.mark.gpus2
def test_a_graphed_lora_step_averages_the_replicated_adapters_on_every_replay():
    # data_parallel kept the adapters whole, no DDP: the buckets' all-reduces are
    # captured with the backward, so each replay averages them (ranks with different
    # batches would otherwise part after the first step).
    pytest.importorskip("peft")
    flags = ["--cuda", "--graph"]
    result, reference, _ = _lora_against_one_process(["data-parallel", *flags], flags)
    assert result["wrapped"] == "PeftModel"
    assert result["spread"] == 0.0
    for ours, theirs in zip(result["losses"], reference["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-3)


@pytest.mark.gpu
def test_a_graphed_ddp_step_captures_the_all_reduce_on_nccl():
    # One rank per GPU; DistributedDataParallel(static_graph=True) lets PyTorch capture
    # its all-reduce, and the whole step replays as one CUDA graph.
    (result,) = _run("--steps", "4", "--graph", ranks=1)
    assert result["losses"][-1] < result["losses"][0]


_IN_PLACE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens")


_ON_CPU = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU job under Triton's interpreter: the GPU machine's Triton 3.6 interpreter "
    "cannot run the fused loss's kernel (a TypeError inside it); there the NCCL tests and "
    "train_hf --nproc run this path on the GPUs",
)


@_ON_CPU
@pytest.mark.parametrize(
    "ddp, model, first, in_place, still_copied",
    [
        ("static", "llama", 3, _IN_PLACE, "o_proj"),  # o_proj, down_proj: F.linear's
        ("plain", "llama", 2, _IN_PLACE, "o_proj"),
        ("unused", "llama", 1, _IN_PLACE, "o_proj"),
        ("static", "checkpointed", 3, _IN_PLACE, "o_proj"),
        ("static", "linear", 3, (*_IN_PLACE, "o_proj", "down_proj"), "norm"),
        ("static", "lora", 3, ("lora_B", "o_proj.lora_A"), "q_proj.lora_A"),  # joined A's
    ],
)
def test_weight_gradients_computed_in_ddps_buckets_equal_ddps_copies_and_are_not_copied(
    ddp, model, first, in_place, still_copied
):
    # Our ops' weight-gradient GEMMs write into DDP's buckets once DDP has rebuilt them
    # (static graph: from the fourth step; without: the third; looking for unused
    # parameters, DDP never rebuilds: the second); the gradients, the AdamW steps and a
    # no_sync micro-step equal those of DDP copying every gradient (the same sums, in
    # the same order), with gradient checkpointing, every linear layer ours, or peft
    # LoRA too.
    pytest.importorskip("transformers")
    if model == "lora":
        pytest.importorskip("peft")
    results = _two_ranks(BUCKET_GRADIENTS, "--ddp", ddp, "--model", model)
    for result in results:
        assert result["accumulated"] == 0.0
        for i, step in enumerate(result["steps"]):
            assert step["grads"] == 0.0 and step["params"] == 0.0
            assert step["copied"]["theirs"] == result["trained"]  # every one, each step
            ours = step["copied"]["ours"]
            if first is None or i < first:  # DDP's buckets before its rebuild: copied
                assert ours == step["copied"]["theirs"]
            else:  # written where DDP reduces them; the rest copied
                assert not any(part in name for name in ours for part in in_place)
                assert any(still_copied in name for name in ours)


@pytest.mark.parametrize(
    "optimizer, device, model",
    [
        pytest.param("adamw", "cpu", "llama", marks=_ON_CPU),
        pytest.param("sgd", "cpu", "llama", marks=_ON_CPU),
        pytest.param("adamw", "cpu", "checkpointed", marks=_ON_CPU),
        pytest.param("adamw", "cpu", "lora", marks=_ON_CPU),
        pytest.param("adamw", "cpu", "fp8", marks=_ON_CPU),
        pytest.param("adamw", "cuda", "llama", marks=pytest.mark.gpus2),
    ],
)
def test_an_optimizer_split_over_the_ranks_steps_as_the_whole_one_with_half_the_state(
    optimizer, device, model
):
    # shard_optimizer from the first step after DDP's rebuild (the third, static graph):
    # the same gradients before each step (clipped), the same parameters after it in the
    # model's state_dict and in a forward right after (each waits for the gathers), over
    # two parameter groups, a schedule and a no_sync micro-step; each rank holds half the
    # optimizer's state (the buckets the forward needs first whole on both); its
    # state_dict is the whole optimizer's, and a whole one's loads into it (one more step
    # after, equal again); what it cannot split is refused, GradScaler's step too. With
    # gradient checkpointing, on peft LoRA (its layers' fused op kept: no wait hooks
    # on them) and with every linear layer's GEMMs in FP8 as well.
    pytest.importorskip("transformers")
    if model == "lora":
        pytest.importorskip("peft")
    results = _two_ranks(
        OPTIMIZER_SHARDS, "--optimizer", optimizer, "--device", device, "--model", model
    )
    for result in results:
        assert [s["sharded"] for s in result["steps"]] == [False, False] + [True] * 6
        if model == "fp8":  # the joined projections and the single layers alike
            assert result["chosen"] == ["fp8"]
        saved = result["saved"]  # its state_dict: the whole optimizer's
        assert saved["groups"] and saved["keys"]
        assert saved["largest"] == 0.0 if device == "cpu" else saved["largest"] < 1e-6
        for step in result["steps"]:
            raw = step["raw"] or 0.0  # every other step
            if device == "cpu":
                assert step["grads"] == step["logits"] == step["params"] == raw == 0.0
            else:  # two models' GPU kernels: apart by rounding already before the split
                assert step["grads"] < 1e-6 and step["logits"] < 1e-5
                assert step["params"] < 1e-6 and raw < 1e-6
            ours, theirs = step["state"]
            if step["sharded"]:  # half, but of the buckets stepped whole, all
                whole = result["whole"]["share"]
                assert theirs / 2 <= ours < theirs * (whole + (1 - whole) / 2) * 1.02
            else:
                assert ours == theirs
        # The tied embedding, in DDP's first bucket, is what the forward needs first:
        # stepped whole, not gathered (its gather held the whole forward, issue 69).
        assert result["whole"]["embedding"] == (model != "lora")
        assert result["whole"]["count"] > 0
        expected = "gloo" if device == "cpu" else "NCCL's"
        assert result["gathers"].startswith(expected)
        if result["gathers"].startswith("NCCL's copy engines"):  # DDP's buckets too
            assert result["gathers"].endswith(", halved all-reduce")
        refused = result["refused"]
        assert len(refused) == 6
        assert "must come from data_parallel" in refused[0] and "got Linear" in refused[0]
        assert "LBFGS is not one of torch.optim's element-wise optimizers" in refused[1]
        assert "not one of the model's parameters" in refused[2]
        assert "sharded already" in refused[3]
        if device == "cpu":
            assert "copy_engines=True needs the model on CUDA GPUs" in refused[4]
        else:
            assert "sharded by shard_optimizer, whose gathers a graph cannot replay" in refused[5]
        assert "not under GradScaler" in refused[4 if device == "cuda" else 5]


def test_data_parallel_sizes_its_buckets_from_the_gradients_it_reduces():
    from xpuruntime.pytorch import distributed

    def model(*shapes, frozen=()):
        layers = torch.nn.ModuleList(torch.nn.Linear(*s, bias=False, device="meta") for s in shapes)
        for i in frozen:
            layers[i].requires_grad_(False)
        return layers

    assert distributed.bucket_size(model((64, 64))) == 25  # a small model keeps DDP's
    assert distributed.bucket_size(model((16384, 16384))) == 85  # 1 GiB / 12
    assert distributed.bucket_size(model(*[(16384, 16384)] * 10)) == 400  # capped
    assert distributed.bucket_size(model(*[(16384, 16384)] * 10, frozen=range(9))) == 85


def test_data_parallel_broadcasts_buffers_only_where_they_are_state():
    # A rotary embedding's frequencies are made from the config on every rank (kept out
    # of the state_dict); BatchNorm's running statistics are state DDP keeps alike.
    transformers = pytest.importorskip("transformers")
    from xpuruntime.pytorch import distributed
    from xpuruntime.pytorch.distributed import _ddp

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    llama = transformers.AutoModelForCausalLM.from_config(config)
    normed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert _ddp.state_buffers(llama) == []
    assert _ddp.state_buffers(normed) == [
        "1.running_mean", "1.running_var", "1.num_batches_tracked"
    ]  # fmt: skip
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert not distributed.data_parallel(llama).broadcast_buffers
        assert distributed.data_parallel(normed).broadcast_buffers
        kept = distributed.data_parallel(normed, broadcast_buffers=False)
        assert not kept.broadcast_buffers  # the user's word stands
    finally:
        torch.distributed.destroy_process_group()


def test_data_parallel_keeps_a_small_trained_share_whole_without_ddp_and_says_what_it_refuses():
    from xpuruntime.pytorch import distributed
    from xpuruntime.pytorch.distributed import _replicated

    def model(trained: int, frozen: int = 4) -> torch.nn.Module:
        layers = [torch.nn.Linear(64, 64, bias=False) for _ in range(frozen)]
        for layer in layers:
            layer.requires_grad_(False)
        return torch.nn.Sequential(*layers, torch.nn.Linear(64, trained, bias=False))

    assert _replicated.replicates(model(8), None, "data_parallel")  # 3% of it: LoRA-like
    assert not _replicated.replicates(model(64), None, "data_parallel")  # 20%
    assert not _replicated.replicates(model(8, frozen=0), None, "data_parallel")  # all trained
    assert _replicated.replicates(model(64), True, "data_parallel")
    with pytest.raises(xrt.InvalidInputError, match="replicate_trained must be True, False"):
        distributed.data_parallel(model(8), replicate_trained="yes")
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        small = model(8)
        assert distributed.data_parallel(small) is small  # unwrapped, its gradients hooked
        for again in (None, False):  # averaged twice otherwise
            with pytest.raises(xrt.InvalidInputError, match="kept whole on every rank already"):
                distributed.data_parallel(small, replicate_trained=again)
        with pytest.raises(xrt.InvalidInputError, match="no DDP buckets to split"):
            distributed.shard_optimizer(small, torch.optim.AdamW(small.parameters()))
        ddp = torch.nn.parallel.DistributedDataParallel
        chosen = distributed.data_parallel(model(8), bucket_cap_mb=50)  # DDP's options: DDP
        assert isinstance(chosen, ddp)
        with pytest.raises(xrt.InvalidInputError, match=r"options \['bucket_cap_mb'\]"):
            distributed.data_parallel(model(8), replicate_trained=True, bucket_cap_mb=50)
        normed = torch.nn.Sequential(model(8), torch.nn.BatchNorm1d(8).requires_grad_(False))
        assert isinstance(distributed.data_parallel(normed), ddp)  # its state broadcast
    finally:
        torch.distributed.destroy_process_group()


@_ON_CPU
@pytest.mark.parametrize(
    "flags", [(), ("--sharded",), ("--checkpointed",), ("--lora",), ("--lora", "--replicated")],
    ids=["sgd", "shard_optimizer", "checkpointed", "lora", "lora_replicated"],
)  # fmt: skip
def test_torch_compile_over_data_parallels_static_graph_trains_as_it_runs_eagerly(flags):
    # The optimized model computes its loss from labels; the logits stay deferred through
    # DDP's output hooks, which dynamo compiles as a frame of their own.
    pytest.importorskip("transformers")
    if "--lora" in flags:
        pytest.importorskip("peft")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    job = [str(COMPILED_DDP), *flags]
    done = subprocess.run(
        [*command, "2", *job], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = _objects(done.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["deferred"]
        assert result["loss"] < 1e-5 and result["grads"] < 1e-5


def test_modules_swapped_by_optimize_leave_fsdp2_their_whole_weights_and_refuse_a_revert():
    # optimize keeps each module it swaps for a revert. Kept with its weights, it held
    # the whole ones after fully_shard put sharded ones in the new module's place: 9 GiB
    # a rank of fp32 o/down weights on the Llama-8B shape under precision="fp8" (2 H200s,
    # 2026-11-30).
    import gc
    import weakref

    transformers = pytest.importorskip("transformers")
    import xpuruntime.pytorch as xpt
    from xpuruntime.pytorch import distributed

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    report = xpt.optimize(model, {"kernels": {"linear": "torch"}})
    swapped = [path for path, was, _ in report.replaced if was.startswith("Linear")]
    assert "lm_head" in swapped and "model.layers.0.self_attn.o_proj" in swapped
    whole = [weakref.ref(model.get_submodule(path).weight) for path in swapped]
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)  # fmt: skip
    try:
        distributed.shard(model)
        gc.collect()
        assert [ref() for ref in whole] == [None] * len(whole)  # freed: nothing kept them
        ids = torch.randint(0, 64, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        # FSDP2 gathers into the modules optimize put there: the originals cannot run
        # again (before, a revert put them back holding the weights from before training).
        with pytest.raises(xrt.UnsupportedOperationError, match="lm_head and .* sharded by"):
            report.revert()
        assert not report.reverted
        model(input_ids=ids, labels=ids).loss.backward()  # nothing changed: it still trains
    finally:
        torch.distributed.destroy_process_group()
        xpt.clear_kernel_policy()


def test_a_swapped_module_the_caller_holds_is_the_one_put_back_with_its_trained_weight():
    import xpuruntime.pytorch as xpt

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    first = model[0]
    report = xpt.optimize(model, {"kernels": {"linear": "torch"}})
    assert model[0] is not first and model[0].weight is first.weight
    model(torch.randn(4, 8)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    weight = model[0].weight
    report.revert()
    assert model[0] is first and first.weight is weight
    assert type(model[1]) is torch.nn.LayerNorm

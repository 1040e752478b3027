"""What a new user meets on the CPU, tried as the README says: the loss in fp32 where
promised, a saved model that loads, the README's keywords, a policy that breaks nothing
it was not asked about, a report of what runs here, a second optimize that says so,
models in other dtypes, transformers' batches, TRL's own head, and the smaller things
(warnings, policy files, the CLI's help), and threads calling one model at once."""

from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._optimize.patterns.training_cache import no_training_cache  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
NO_CUDA = not torch.cuda.is_available()


def _llama(vocab: int = 96, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _ids(vocab: int = 96, rows: int = 2, tokens: int = 16):
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.skipif(not NO_CUDA, reason="the CPU path")
def test_the_chunked_loss_under_bf16_autocast_is_fp32_as_transformers_computes_it():
    """F.linear_cross_entropy returns a bf16 head's loss in bf16 (the quick start's 6.906
    against transformers' 6.939): the torch_chunked kernel gives the fp32 loss."""
    model, ids = _llama(vocab=1000), _ids(vocab=1000, tokens=64)
    with torch.autocast("cpu", torch.bfloat16):
        want = model(input_ids=ids, labels=ids).loss
    xpt.optimize(model, {"kernels": {"cross_entropy": "torch_chunked"}})
    with torch.autocast("cpu", torch.bfloat16):
        got = model(input_ids=ids, labels=ids).loss
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) < 2e-3, (got.item(), want.item())
    assert got.item() != got.to(torch.bfloat16).float().item()  # not rounded to bf16
    got.backward()
    assert model.lm_head.weight.grad is not None


def test_an_optimized_model_saved_whole_loads_and_computes_the_same():
    """torch.save(model) of an optimized model (and of a peft one): pickle rebuilds the
    forwards bound on instances by name, so the loaded model runs its classes' own
    (the same computation), and optimize fuses it again (the hook that keeps KV caches
    out of training forwards pickled with the model, and not added twice)."""
    from peft import LoraConfig, get_peft_model

    ids = _ids()
    for model in (_llama(), get_peft_model(_llama(), LoraConfig(target_modules="all-linear"))):
        xpt.optimize(model)
        want = model(input_ids=ids, labels=ids).loss
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss, want)
        again = xpt.optimize(loaded)
        assert again.fused_swiglus and again.fused_ropes, str(again)
        assert list(loaded._forward_pre_hooks.values()).count(no_training_cache) == 1
        torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss, want)


def test_make_train_step_takes_the_readmes_cuda_graph_keyword():
    """The README writes make_train_step(..., cuda_graph=True)."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "make_train_step(..., cuda_graph=True)" in readme
    assert "cuda_graph" in inspect.signature(xpt.make_train_step).parameters
    model, ids = _llama(), _ids()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"input_ids": ids, "labels": ids}
    step, report = xpt.make_train_step(model, lambda out, _: out.loss, optimizer, batch,
                                       cuda_graph=False)  # fmt: skip
    assert isinstance(step, xpt.TrainStep)
    report.revert()
    with pytest.raises(xrt.InvalidInputError, match="cuda_graph"):
        xpt.make_train_step(model, lambda out, _: out.loss, optimizer, batch, cuda_graph="yes")
    if NO_CUDA:
        with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
            xpt.make_train_step(model, lambda out, _: out.loss, optimizer, batch,
                                cuda_graph=True)  # fmt: skip


@pytest.mark.skipif(not NO_CUDA, reason="a machine without CUDA")
@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_an_sdpa_backend_that_cannot_run_here_breaks_no_model(kernel):
    """Strict: refused when set, nothing changed. Not strict: the switches are left as
    they are, with a warning, and the report says PyTorch's choice runs."""
    model, ids = _llama(), _ids()
    with pytest.raises(xrt.UnsupportedOperationError, match="CUDA devices"):
        xpt.set_kernel_policy({"kernels": {"attention": kernel}, "strict": True})
    assert xpt.get_kernel_policy() is None
    model(input_ids=ids)
    with pytest.warns(xrt.FallbackWarning, match="switches are left"):
        report = xpt.optimize(model, {"kernels": {"attention": kernel}})
    assert "keep PyTorch's backend choice" in report.attention
    model(input_ids=ids).logits.sum().backward()
    _llama(seed=1)(input_ids=ids)  # another model too


def test_the_report_says_what_runs_in_this_mode():
    """What takes effect only under torch.compile or for packed batches is said apart
    from what runs now."""
    report = xpt.optimize(_llama())
    first = str(report).splitlines()[0]
    now, _, later = first.partition("; under torch.compile or graph capture: ")
    assert "causal mask" not in now and "head(s)" not in now
    assert later.startswith("left 1 causal mask(s) to SDPA's is_causal;")
    assert "; under torch.compile: kept 1 head(s) and loss outside the graph" in later


@pytest.mark.skipif(not NO_CUDA, reason="a CPU without Triton's interpreter")
def test_on_a_cpu_the_report_says_pytorchs_kernels_run_what_triton_would_fuse():
    """A CPU user without TRITON_INTERPRET: Triton is installed but runs nothing here."""
    code = (
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from xpuruntime import pytorch as xpt\n"
        "config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)\n"
        "print(xpt.optimize(LlamaForCausalLM(config)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, *lines = out.stdout.splitlines()
    assert "fused 2 SwiGLU" not in first and "fused 2 residual" not in first
    assert "2 SwiGLU(s) and 2 rotary embedding(s) to PyTorch's kernels on cpu" in first
    assert "packed" not in first  # our document attention cannot run here either
    assert (
        "  model.layers.{0-1}.mlp: its SwiGLU runs as one op where Triton runs; on cpu, "
        "PyTorch's kernels" in lines
    )
    assert any(line.startswith("cpu: Triton kernels run on CUDA devices") for line in lines)


def test_the_report_groups_the_lines_repeated_per_layer():
    report = str(xpt.optimize(_llama(layers=4)))
    assert "  model.layers.{0-3}.mlp: gate_proj, up_proj: run as one op" in report
    assert "model.layers.0." not in report


def test_optimizing_twice_says_so_and_revert_order_does_not_matter():
    model = _llama()
    first = xpt.optimize(model, {"kernels": {"rmsnorm": "torch"}})
    with pytest.warns(UserWarning, match="already optimized"):
        second = xpt.optimize(model, {"kernels": {"rmsnorm": "fused"}})
    assert any("already optimized" in why for _, why in second.skipped)
    assert not second.replaced and xpt.get_kernel_policy().get("rmsnorm") == "fused"
    first.revert()  # out of order: the second's policy stays until it is reverted
    assert xpt.get_kernel_policy().get("rmsnorm") == "fused"
    second.revert()
    assert xpt.get_kernel_policy() is None
    again = xpt.optimize(model)  # reverted: optimized afresh
    assert again.fused_swiglus


def test_an_fp64_model_is_left_as_written_and_trains_as_its_own():
    model, ids = _llama().double(), _ids()
    reference = _llama().double()
    want = reference(input_ids=ids, labels=ids).loss
    report = xpt.optimize(model)
    assert any("float64" in why for _, why in report.skipped), str(report)
    assert not report.fused_swiglus and not report.fused_ropes
    got = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want)
    got.backward()


def test_a_train_step_takes_transformers_batches_and_says_why_a_loss_is_none():
    model, ids = _llama(), _ids()
    optimizer = torch.optim.AdamW(model.parameters())
    step, _ = xpt.make_train_step(
        model, lambda out, _: out.loss, optimizer, {"input_ids": ids, "labels": ids}
    )
    loss = step({"input_ids": ids, "labels": ids})
    assert loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(xrt.InvalidInputError, match="only when the batch has labels"):
        step({"input_ids": ids})
    with pytest.raises(xrt.InvalidInputError, match="mapping"):
        step([ids])


def test_under_trls_fused_head_the_report_says_why_the_head_stays_in_the_graph():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    model = _llama()
    add_fused_lm_head(model)
    report = xpt.optimize(model)
    said = [why for path, why in report.skipped if path == "<model>"]
    assert any("TRL's, bound on the instance by SFTTrainer" in why for why in said), said


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter")
def test_under_the_interpreter_our_attention_refuses_bf16():
    from xpuruntime.pytorch._ops.flash_attention import unsupported

    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert "bf16 wrongly" in unsupported(q, q, q)
    assert unsupported(q.half(), q.half(), q.half()) is None


def test_logits_of_an_inference_forward_are_read_without_a_warning():
    model, ids = _llama(), _ids()
    xpt.optimize(model)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(input_ids=ids).logits.argmax(-1)


def test_a_user_filter_lists_what_it_refused():
    report = xpt.optimize(_llama(), filter=lambda module, path: path != "model.layers.1")
    assert ("model.layers.1", "the filter refused it: left as written") in report.skipped


def test_every_finding_is_documented_where_users_read_the_report():
    # The training guide's list of the report's fields is made from each finding's doc
    # (scripts/docs_hooks.py), and the report's docstring points there.
    import importlib.util
    from pathlib import Path

    from xpuruntime.pytorch._optimize.patterns import FINDINGS

    hooks = Path(__file__).resolve().parents[1] / "scripts" / "docs_hooks.py"
    spec = importlib.util.spec_from_file_location("docs_hooks", hooks)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.on_page_markdown("<!-- findings -->")
    assert [
        f.field for f in FINDINGS if f"| `{f.field}` | {f.doc.replace('``', '`')} |" not in page
    ] == []
    assert "patterns.FINDINGS" in xpt.OptimizationReport.__doc__


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("twice.json", '{"kernels": {"rmsnorm": "fused"}, "kernels": {"rmsnorm": "torch"}}'),
        ("twice.yaml", "kernels:\n  rmsnorm: fused\nkernels:\n  rmsnorm: torch\n"),
    ],
)
def test_a_policy_file_giving_a_key_twice_is_refused(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(xrt.PolicyError, match="twice"):
        xrt.KernelPolicy.load(path)


def test_policy_validate_says_which_field_a_typo_meant_in_either_kind(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text('{"kernals": {"rmsnorm": "fused"}, "strict": true}')
    out = subprocess.run(
        [sys.executable, "-m", "xpuruntime.cli", "policy", "validate", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    said = " ".join(out.stderr.split())
    assert "'kernals' (did you mean 'kernels'?)" in said and "as a kernel policy" in said


def test_the_command_lines_help_shows_no_rest_markup():
    out = subprocess.run(
        [sys.executable, "-m", "xpuruntime.cli", "--help"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and "``" not in out.stdout


def test_threads_calling_an_optimized_model_at_once_get_its_outputs():
    """Four threads calling one optimized model at once, at shapes of their own, each
    get what the model computes alone. Under Triton's interpreter too: its launches
    share module state, so they run one at a time."""
    import copy

    from at_once import at_once

    model = _llama()
    reference = copy.deepcopy(model)
    xpt.optimize(model)
    model.eval()
    reference.eval()
    batches = [_ids(rows=rows, tokens=tokens) for rows, tokens in ((1, 5), (2, 12), (3, 7))]
    with torch.no_grad():
        wanted = [reference(input_ids=ids).logits for ids in batches]
    failures = []

    def call(first: int) -> None:
        try:
            for i in range(first, first + 4):
                ids, want = batches[i % 3], wanted[i % 3]
                with torch.no_grad():
                    got = model(input_ids=ids).logits
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        except Exception as e:  # (a thread's failure, raised below)
            failures.append(e)

    at_once(call, threads=4, timeout=300)
    assert not failures, failures[0]


def test_labels_of_another_shape_are_refused_naming_both_and_nothing_is_poisoned():
    """Labels cut shorter than the ids are refused by name, as transformers refuses them
    (a ValueError); a label outside the vocabulary gives a NaN loss, never a read out of
    bounds; the next call trains as before either way."""
    model = _llama()
    xpt.optimize(model)
    ids = _ids()
    want = model(input_ids=ids, labels=ids).loss
    with pytest.raises(xrt.InvalidInputError, match="32 rows and the target 20") as refused:
        model(input_ids=ids, labels=ids[:, :10])
    assert isinstance(refused.value, ValueError)
    outside = ids.clone()
    outside[0, 3] = 1000
    assert torch.isnan(model(input_ids=ids, labels=outside).loss)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want)


@pytest.mark.parametrize("tied", [True, False])
def test_a_vocabulary_resized_after_optimize_trains_as_the_plain_models(tied):
    """Tokens added after optimize: a tied head resizes with the embedding; an untied one
    transformers refuses (our head is not an nn.Linear), and reverting, resizing and
    optimizing again, as docs/training.md says, gives the plain model's loss."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    model = copy.deepcopy(plain)
    report = xpt.optimize(model)
    try:
        model.resize_token_embeddings(104, mean_resizing=False)
    except TypeError as refused:  # (transformers 5's _get_resized_lm_head)
        assert not tied and "LinearCrossEntropyHead" in str(refused)
        report.revert()
        model.resize_token_embeddings(104, mean_resizing=False)
        xpt.optimize(model)
    assert type(model.lm_head).__name__ == "LinearCrossEntropyHead"
    plain.resize_token_embeddings(104, mean_resizing=False)
    model.load_state_dict(plain.state_dict())  # (the rows added are drawn at random)
    ids = _ids(vocab=104)
    torch.testing.assert_close(
        model(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss
    )

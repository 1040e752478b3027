"""The shape of xpuruntime.pytorch: one vocabulary, kernels registered in its order,
ops/ a floor, routed ops' decisions on the records, FlashAttention-4's refusals."""

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.kernels import FallbackWarning, registry  # noqa: E402
from xpuruntime.policies import KernelPolicy  # noqa: E402
from xpuruntime.policies._choices import KERNEL_CHOICES  # noqa: E402
from xpuruntime.pytorch._kernels import auto_order, register_kernels  # noqa: E402

OPS = Path(xpt.__file__).parent / "_ops"


pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


@pytest.mark.parametrize(
    "op", [op for op in KERNEL_CHOICES if op not in ("matmul", "conv")] + ["matmul", "conv"]
)
def test_kernels_are_registered_in_the_vocabularys_order(op):
    register_kernels()
    assert registry.names(op) == auto_order(op) == [k for k in KERNEL_CHOICES[op] if k != "auto"]


@pytest.mark.parametrize("path", sorted(OPS.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS)))
def test_ops_modules_import_nothing_from_the_package_above(path):
    # A relative import one level above the file's packages inside _ops/ lands in
    # xpuruntime.pytorch (what the ops' floor must not read); higher ones, xpuruntime's.
    to_pytorch = len(path.relative_to(OPS).parts) + 1
    upward = [
        node.module
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == to_pytorch
    ]
    assert upward == [], f"{path.name} imports {upward} from xpuruntime.pytorch"


def test_the_drop_in_modules_former_names_are_aliases():
    assert xpt.ops.FusedLayerNorm is xpt.nn.LayerNorm
    assert xpt.ops.FusedRMSNorm is xpt.nn.RMSNorm
    assert xpt.ops.FusedLinear is xpt.nn.Linear
    assert xpt.ops.fused_attention is xpt.fused_attention


@pytest.mark.parametrize("op", ["linear_gelu", "mlp"])
def test_cublaslt_is_spelled_one_way_and_the_old_spelling_is_accepted(op):
    assert KernelPolicy(**{op: "cublaslt"}).get(op) == "cublasLt"
    assert "cublasLt" in KERNEL_CHOICES[op]


def test_a_routed_ops_records_carry_its_decision():
    norm = xpt.nn.LayerNorm(16)
    x = torch.randn(4, 16)
    with xpt.kernel_policy(layernorm="torch"):
        xpt.enable_dispatch_logging()
        norm(x)
        xpt.disable_dispatch_logging()
    records = [r for r in xpt.get_dispatch_logs() if r.op == "layernorm" and "aten_op" in r.context]
    assert records and all(r.chosen == "torch" and r.source == "policy" for r in records)
    assert all("decision" in r.context["via"] for r in records)


def test_flash_v4_says_why_it_cannot_run_here():
    q = torch.randn(1, 2, 8, 64)
    kernel = registry.get("attention", "flash_v4")
    from xpuruntime.pytorch._kernels._context import AttentionContext

    support = kernel.supports(AttentionContext(q, q, q, None, 0.0, False, False, False))
    assert not support.ok and "CUDA" in support.reason


def test_a_strict_flash_v4_policy_is_refused_where_fa4_cannot_run_and_nothing_changes():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    with pytest.raises(xrt.UnsupportedOperationError, match="flash_v4.*CUDA"):
        xpt.set_kernel_policy(attention="flash_v4", strict=True)
    assert xpt.get_kernel_policy() is None


def test_a_flash_v4_policy_falls_back_with_a_warning_where_fa4_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    q = torch.randn(1, 2, 8, 64)
    with pytest.warns(FallbackWarning, match="flash_v4"):
        xpt.set_kernel_policy(attention="flash_v4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = xpt.ops.fused_attention(q, q, q)
    assert any(issubclass(w.category, FallbackWarning) for w in caught)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_torch_side_decisions_and_ranges_reach_xrts_profiler():
    profiler = xrt.Profiler.instance()
    profiler.clear()
    profiler.enable()
    try:
        q = torch.randn(1, 2, 8, 16)
        with xpt.kernel_policy(attention="math"):
            xpt.ops.fused_attention(q, q, q)
    finally:
        profiler.disable()
    names = [e["name"] for e in profiler.events]
    profiler.clear()
    assert "decide attention: math" in names
    assert "xrt::attention[math]" in names


def test_fused_attention_needs_no_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if Triton were not installed\n"
        "import torch\n"
        "from xpuruntime import pytorch as xpt\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "with xpt.kernel_policy(attention='math'):\n"
        "    print(tuple(xpt.ops.fused_attention(q, q, q).shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "(1, 2, 8, 16)"


@pytest.mark.parametrize("op", ["linear", "linear_gelu", "mlp"])
def test_best_performance_can_time_a_linear_ops_kernels_on_the_sample_it_builds(op):
    from xpuruntime.pytorch._kernels._context import LinearContext, MLPContext
    from xpuruntime.pytorch._selection._routed import ROUTED_OPS

    register_kernels()
    x = torch.randn(4, 8, requires_grad=True)
    layer = (x, 16, torch.float32, torch.float32, True, False)
    if op == "mlp":
        ctx = MLPContext(*layer, "tanh", 8)
    else:
        ctx = LinearContext(*layer, None if op == "linear" else "tanh")
    seconds = ROUTED_OPS[op]._time(registry.get(op, "torch").planned(ctx), ctx, ())
    assert seconds > 0


_WITHOUT_TRITON = """
import importlib.machinery, sys

class Hidden:  # the path finder of a machine where Triton is not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        found = importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
        return (d for d in found if d.metadata["Name"] != "triton")

    @classmethod
    def invalidate_caches(cls):
        importlib.machinery.PathFinder.invalidate_caches()

sys.meta_path[:] = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import xpuruntime as xrt
import xpuruntime.pytorch as xpt

config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
model, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
reference.load_state_dict(model.state_dict())
report = xpt.optimize(model)
ids = torch.randint(0, 96, (2, 12))
loss, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
loss.backward(), want.backward()
torch.testing.assert_close(loss, want)
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad)
print("triton" in sys.modules, len(report.replaced), report.fused_swiglus)
print(report.skipped[0][1])
report.revert()
try:
    xpt.optimize(model, {"strict": True})
except xrt.BackendUnavailableError as e:
    print("strict:", e)
"""


def test_optimize_without_triton_runs_pytorchs_kernels_and_says_what_it_left():
    """A CPU-only PyTorch install or macOS has no Triton: the norms are replaced and run
    PyTorch's kernels, the fusions are left as written and the report says why; strict
    refuses. Run where Triton's import is blocked as on such a machine."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    imported, why, strict = out.stdout.strip().splitlines()
    assert imported == "False 5 []"
    assert why.startswith("Triton is not installed") and "swiglu" in why
    assert strict.startswith("strict: optimize: Triton is not installed")


def test_optimizes_patterns_run_in_the_order_their_table_pins():
    """Per module: the gated MLP, then the rewritten forward (its statement kinds residual
    before linear and GELU, then projections), a LoRA layer, the LM head, the swaps; the fx rewrite
    over the whole model, then the KV-cache finding, the layers' graphs last. The report lists findings in the
    summary's order."""
    from xpuruntime.pytorch._optimize import patterns

    assert [type(p).__name__ for p in patterns.MODULE_PATTERNS] == [
        "GatedMLP", "RewrittenForward", "Lora", "Head", "Swaps",
    ]  # fmt: skip
    assert [p.kind for p in patterns.STATEMENTS] == [
        "residual", "linear_act", "projections", "head_norms",
    ]  # fmt: skip
    assert [type(p).__name__ for p in patterns.MODEL_PATTERNS] == [
        "FxRewrite", "Offload", "Fp8Base", "Fp8Activations", "TrainingCache", "GraphedLayers",
    ]  # fmt: skip
    assert [f.field for f in patterns.FINDINGS] == [
        "fused_residuals", "fused_gelus", "fused_mlps", "fused_swiglus", "fused_geglus",
        "fused_ropes", "fused_head_norms", "joined_projections", "stored_joined", "fused_loras",
        "bare_4bit_layers",
        "causal_masks_left_to_sdpa",
        "packed_masks_as_documents", "packed_positions_read_on_device", "host_syncs_removed",
        "heads_outside_the_graph",
        "offloaded_checkpoints", "fp8_bases", "fp8_activations", "kv_caches_in_training",
        "graphed_layers", "watched_layers",
    ]  # fmt: skip


def test_optimize_refuses_a_filter_it_cannot_call():
    with pytest.raises(xrt.InvalidInputError, match="filter must be a callable"):
        xpt.optimize(torch.nn.Linear(2, 2), filter="vision_tower")


def test_every_pattern_has_its_kinds_contract_and_the_findings_table_is_theirs():
    """Each member of the tables is one of the pattern kinds (``patterns/_contracts.py``),
    and the report's findings are exactly those its patterns list, each once."""
    from xpuruntime.pytorch._optimize import patterns
    from xpuruntime.pytorch._optimize.patterns import _contracts, causal_mask, rope

    assert all(isinstance(p, _contracts.ModulePattern) for p in patterns.MODULE_PATTERNS)
    assert all(isinstance(p, _contracts.ModelPattern) for p in patterns.MODEL_PATTERNS)
    assert all(isinstance(s, _contracts.StatementKind) for s in patterns.STATEMENTS)
    assert all(isinstance(p, _contracts.ForwardPart) for p in (rope.PATTERN, causal_mask.PATTERN))
    listed = [f for p in (*patterns.MODULE_PATTERNS, *patterns.MODEL_PATTERNS) for f in p.findings]
    assert len(patterns.FINDINGS) == len(set(patterns.FINDINGS))
    assert set(patterns.FINDINGS) == set(listed)
    # Each says what its list holds in one line (the docs' list of report fields).
    assert all(f.doc and "\n" not in f.doc for f in patterns.FINDINGS)

"""Models we did not write: Hugging Face transformers' own modeling code, built from tiny
configs (random weights, nothing downloaded), through ``optimize()``.

The fused loss must never build the logits on transformers' own loss path
(``ForCausalLMLoss`` calls ``logits.float()``, views and ``F.cross_entropy``, with
``num_items_in_batch`` turning the mean into a sum), nor in a user's loop that slices
``logits[:, :-1]``; logits read after the loss materialise then; ``generate()`` keeps
working; ``revert()`` gives back the model bit for bit."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from host_reads import host_reads  # noqa: E402
from tensors_made import tensors_made  # noqa: E402
from tiny_configs import SMALL, cache_argument, output_cache  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._functional._lm_head import DeferredLogits  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("our kernels run on the CPU under TRITON_INTERPRET=1", allow_module_level=True)
POLICY = {
    "kernels": {
        "cross_entropy": "fused_linear",
        "rmsnorm": "fused",
        "swiglu": "fused",
        "geglu": "fused",
        "rope": "fused",
        "residual_rmsnorm": "fused",
        "projections": "fused",
    },
    "strict": True,
}


def _llama_pair(tied: bool = True):
    """A tiny Llama and an untouched copy with the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).to(DEVICE)
    model = LlamaForCausalLM(config).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    return model, reference


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 12), generator=generator).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions, as padding gives
    return ids, labels


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """The materialising warning is said once per process; each test sees its own."""
    from xpuruntime.pytorch._functional import _lm_head

    monkeypatch.setattr(_lm_head, "_warned", set())


@pytest.fixture
def materialised(monkeypatch):
    """Counts every time deferred logits are computed."""
    calls: list[tuple] = []
    original = DeferredLogits.materialize

    def counted(self):
        calls.append(tuple(self.shape))
        return original(self)

    monkeypatch.setattr(DeferredLogits, "materialize", counted)
    return calls


def _trains_as(model, reference, tolerances=(2e-5, 1e-4)):
    """One step of transformers' own loss on both, without a cache: the same loss, every
    gradient alike (within ``tolerances``: the loss's, the gradients'); the loss."""
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    loss, grads = tolerances
    torch.testing.assert_close(out.loss, want.loss, atol=loss, rtol=loss)
    _grads_close(model, reference, tolerance=grads)
    return want.loss


def _grads_close(model, reference, tolerance=1e-5):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", ["fused_linear", "torch_chunked"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("items", [None, 17])
def test_transformers_own_loss_path_never_builds_the_logits(materialised, tied, items, kernel):
    """Ours, and PyTorch's chunked F.linear_cross_entropy (torch >= 2.13) as the other
    candidate of the cross_entropy op."""
    if kernel == "torch_chunked" and not hasattr(F, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    model, reference = _llama_pair(tied)
    report = xpt.optimize(
        model, {**POLICY, "kernels": {**POLICY["kernels"], "cross_entropy": kernel}}
    )
    assert ("lm_head", "LinearCrossEntropyHead") in {(p, new) for p, _, new in report.replaced}
    ids, labels = _batch()
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    out = model(input_ids=ids, labels=labels, **extra)
    with tensors_made() as made:
        out.loss.backward()
    want = reference(input_ids=ids, labels=labels, **extra)
    want.loss.backward()
    assert materialised == []
    shapes = [tuple(t.shape) for t in made]
    vocab_rows = [s for s in shapes if s[-1:] == (96,) and math.prod(s) >= ids.numel() * 96 // 2]
    assert vocab_rows == []  # nothing logits-sized in the backward: no zeros for them either
    torch.testing.assert_close(out.loss, want.loss, atol=1e-5, rtol=1e-5)
    _grads_close(model, reference)


def test_a_users_loop_that_slices_the_logits_never_builds_them(materialised):
    model, reference = _llama_pair()
    xpt.optimize(model, POLICY)
    ids, _ = _batch()

    def loss_of(m):
        logits = m(input_ids=ids).logits[:, :-1, :].contiguous()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    loss, want = loss_of(model), loss_of(reference)
    loss.backward()
    want.backward()
    assert materialised == []
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    _grads_close(model, reference)


def test_logits_read_after_the_loss_are_the_models_logits(materialised):
    model, reference = _llama_pair()
    xpt.optimize(model, POLICY)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert materialised == []
    with torch.no_grad(), pytest.warns(UserWarning, match="materialised"):
        predicted = out.logits[:, :-1].float().argmax(-1)  # token accuracy, as TRL logs it
    assert materialised == [(2, 11, 96)]  # read, so computed: the caller asked for them
    with torch.no_grad():
        assert torch.equal(predicted, reference(input_ids=ids).logits[:, :-1].argmax(-1))


def test_generate_on_an_optimized_model_gives_the_models_tokens():
    model, reference = _llama_pair()
    xpt.optimize(model, POLICY)
    ids, _ = _batch()
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with warnings.catch_warnings():  # an inference forward's logits: read without a word
        warnings.filterwarnings("error", message=".*materialised")
        tokens = model.generate(ids, **settings)
    assert torch.equal(tokens, reference.generate(ids, **settings))


def test_revert_gives_back_the_model_bit_for_bit():
    model, reference = _llama_pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    report = xpt.optimize(model, POLICY)
    assert report.fused_swiglus == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert len(report.fused_ropes) == 2
    assert report.joined_projections == [
        "model.layers.0.self_attn: q_proj, k_proj, v_proj",
        "model.layers.0.mlp: gate_proj, up_proj",
        "model.layers.1.self_attn: q_proj, k_proj, v_proj",
        "model.layers.1.mlp: gate_proj, up_proj",
    ]
    assert "forward" not in reference.model.layers[0].mlp.__dict__  # bound per instance
    assert "forward" not in reference.model.layers[0].self_attn.__dict__
    ids, labels = _batch()
    model(input_ids=ids, labels=labels).loss.backward()
    report.revert()
    assert [type(m) for m in model.modules()] == classes
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


# -- the architectures people train, from their tiny configs -------------------------------
_ARCHITECTURES = {
    # model type: (its config's extra fields, what its final logits go through)
    "llama": ({}, None),
    "qwen2": ({}, None),
    "qwen3": ({}, None),
    "mistral": ({}, None),
    "ministral": ({}, None),
    "smollm3": ({}, None),
    "phi3": ({}, None),
    "olmo2": ({}, None),
    "glm4": ({}, None),
    "gemma2": ({}, "a final logit softcap"),
    "gemma3_text": ({"layer_types": ["sliding_attention", "full_attention"]}, None),
    "granite": ({}, "/ logits_scaling"),
    "cohere": ({}, "* logit_scale"),
    "starcoder2": ({}, None),  # LayerNorm decoder layers, a GELU MLP of nn.Linear layers
    "gpt2": (
        {
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
        None,
    ),
    "qwen3_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, None),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "gpt_oss": (
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        None,
    ),
    "deepseek_v3": (
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 4,  # its rotary part: qk_rope_head_dim
            "num_key_value_heads": 4,
        },
        None,
    ),
}
# RMSNorm look-alikes that compute something else, and what the report must say.
# (Gemma's (1 + weight) norms are replaced, scaling by 1 + weight.)
_NORMS_LEFT = {"cohere": "does not"}
# MLPs whose SwiGLU runs as the swiglu op: every layer's in the Llama family, Phi-3's and
# GLM4's too (gate and up packed in one gate_up_proj); DeepSeek-V3's dense first layer (its
# MoE layers' experts are fused tensors, as Mixtral's, Qwen3-MoE's and GPT-OSS's are).
# Gemma's MLPs are GeGLU, run as the geglu op.
_SWIGLUS = {"deepseek_v3": 1, "gemma2": 0, "gemma3_text": 0, "gpt2": 0, "gpt_oss": 0,
            "mixtral": 0, "qwen3_moe": 0, "starcoder2": 0}  # fmt: skip


# Attention layers whose rotary embedding runs as the rope op: both layers' wherever the
# modeling file's apply_rotary_pos_emb computes the half-split rotation (Llama's and its
# copies; Phi-3's partial form takes full-width angles here, and falls back to its own
# code on narrower ones) or the interleaved one (Cohere's). Left with the reason: GLM4
# (interleaved over half the angles), GPT-OSS (another signature); GPT-2 has none.
_ROPES = {"glm4": "neither the half-split", "gpt_oss": "does not take", "gpt2": None}


# Decoder layers whose `h = residual + h; residual = h; h = norm(h)` runs as the
# residual_rmsnorm op (Starcoder2's, with a LayerNorm, as residual_layernorm), one per
# layer: the add after attention and the norm before the MLP (the add at a layer's end
# meets the next layer's norm in another module's forward); the operands as written
# (Granite's `residual + h * multiplier`, Phi-3's `residual + self.dropout(h)`); GPT-2's
# with its cross-attention `if` between the add and `residual = h` (fused where the `if`
# would not run). Left as written: Cohere (attention and MLP in parallel), OLMo2 (norms
# after the branches: its add meets the MLP, not a norm).
_RESIDUALS_LEFT = {"cohere", "olmo2"}


# Linear layers of one input run as the projections op (one GEMM), per layer: attention's
# q, k and v (the statements calling them on the same hidden states, consecutive in the
# forward) and the MLP's gate and up where its gated activation is ours. GPT-2 and Phi-3
# pack them in one layer already; DeepSeek-V3's attention projects through low-rank
# layers (its one dense MLP joins); the MoE families' experts are fused tensors.
_JOINED = {"gpt2": 0, "phi3": 0, "deepseek_v3": 1, "glm4": 2, "gpt_oss": 2, "mixtral": 2,
           "qwen3_moe": 2, "starcoder2": 2}  # fmt: skip


def _pair_of(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, _ = _ARCHITECTURES[model_type]
    config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).to(DEVICE)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    return model, reference


@pytest.mark.parametrize("model_type", sorted(_ARCHITECTURES))
def test_optimize_matches_the_norms_it_can_run_and_trains_every_architecture_the_same(
    model_type, materialised, recwarn
):
    model, reference = _pair_of(model_type)
    report = xpt.optimize(model, POLICY)
    replaced = {path: new for path, _, new in report.replaced}
    skipped = dict(report.skipped)
    assert replaced.get("lm_head") == "LinearCrossEntropyHead"
    norms = [p for p, m in reference.named_modules() if "norm" in type(m).__name__.lower()]
    norms += [p for p, m in reference.named_modules() if type(m).__name__ == "LayerNorm"]
    assert norms
    for path in norms:  # every norm replaced, or left with what it computes
        if model_type in _NORMS_LEFT:
            assert _NORMS_LEFT[model_type] in skipped[path], (path, skipped.get(path))
        else:
            assert replaced[path] in ("xpt.nn.RMSNorm", "xpt.nn.LayerNorm"), path
    assert len(report.fused_swiglus) == _SWIGLUS.get(model_type, 2), report.fused_swiglus
    residuals = 0 if model_type in _RESIDUALS_LEFT else 2
    assert len(report.fused_residuals) == residuals, report.fused_residuals
    assert len(report.joined_projections) == _JOINED.get(model_type, 4), report.joined_projections
    # GPT-2's MLP (its Conv1D c_fc and NewGELUActivation) and Starcoder2's (nn.Linear and
    # GELU's tanh form) run as the linear_gelu op
    gelus = {
        "gpt2": ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"],
        "starcoder2": ["model.layers.0.mlp.c_fc", "model.layers.1.mlp.c_fc"],
    }.get(model_type, [])
    assert report.fused_gelus == gelus
    if model_type.startswith("gemma"):
        assert report.fused_geglus == ["model.layers.0.mlp", "model.layers.1.mlp"]
    if model_type in _ROPES:
        assert report.fused_ropes == []
        if _ROPES[model_type]:
            assert _ROPES[model_type] in skipped["model.layers.0.self_attn"]
    else:
        assert report.fused_ropes == [f"model.layers.{i}.self_attn" for i in range(2)]
    _trains_as(model, reference)
    # Models that transform their logits before the loss (a scale, a soft cap) too
    assert materialised == [], "the logits were built on the model's own loss path"
    assert not any("materialised" in str(w.message) for w in recwarn)


@pytest.mark.parametrize(
    "policy, bound",
    [({"auto_strategy": "best_performance"}, True), (None, True),
     ({"kernels": {"swiglu": "torch", "rope": "torch"}}, False)],
)  # fmt: skip
def test_auto_binds_the_swiglu_and_rope_ops_and_a_policy_naming_torch_leaves_them(policy, bound):
    """Under auto the ops decide per call (as for the norms); naming torch keeps the
    modeling file's code."""
    model, reference = _pair_of("llama")
    report = xpt.optimize(model, policy)
    assert len(report.fused_swiglus) == len(report.fused_ropes) == (2 if bound else 0)
    _trains_as(model, reference)
    if bound and policy is not None:
        from xpuruntime.pytorch._selection._routed import ROUTED_OPS

        assert {d.source for d in ROUTED_OPS["swiglu"].decisions.values()} == {"auto"}
    report.revert()


def test_measured_auto_keeps_every_default_that_another_kernel_beats_only_by_noise(
    monkeypatch,
):
    """best_performance on a whole model, every candidate other than the default timed
    2% faster (within any measurement's noise): each call shape keeps the kernel
    first_supported picks, and its reason says what was measured."""
    from xpuruntime.kernels import registry
    from xpuruntime.pytorch._selection import _routed
    from xpuruntime.pytorch._selection._routed import ROUTED_OPS

    def resolve(op, ctx, order, measure, unmeasured=None):
        default = next(n for n in order if registry.get(op, n).supports(ctx).ok)
        fake = lambda kernel: 1.0 if kernel.name == default else 0.98  # noqa: E731
        return real(op, ctx, order, fake, unmeasured)

    real = _routed.resolve_per_call
    chosen = {}
    for policy in (None, {"auto_strategy": "best_performance"}):
        model, reference = _pair_of("llama")
        if policy is not None:
            monkeypatch.setattr(_routed, "resolve_per_call", resolve)
        report = xpt.optimize(model, policy)
        _trains_as(model, reference)
        chosen[bool(policy)] = {
            op: sorted(d.chosen for d in routed.decisions.values())
            for op, routed in ROUTED_OPS.items()
        }
        reasons = [d.reason for r in ROUTED_OPS.values() for d in r.decisions.values()]
        report.revert()
    assert chosen[True] == chosen[False] and any(chosen[True].values())
    assert any("the default, kept" in reason for reason in reasons), reasons
    # Joining projections saves time after the op, which timing it alone cannot see.
    assert any("not measured: what joining saves" in reason for reason in reasons), reasons


def test_a_user_filter_leaves_the_modules_it_refuses_as_written():
    """optimize(model, filter=fn(module, path)), as torchao's filter_fn: a module the
    filter refuses keeps its class and forward (a vision tower, here a decoder layer);
    the rest is optimized, and the model trains as the unoptimized one."""
    model, reference = _llama_pair()
    seen = []

    def keep_layer_one(module, path):
        seen.append(path)
        return not path.startswith("model.layers.1")

    report = xpt.optimize(model, POLICY, filter=keep_layer_one)
    assert "model.layers.1.mlp" in seen
    assert report.fused_swiglus == ["model.layers.0.mlp"]
    assert report.fused_ropes == ["model.layers.0.self_attn"]
    layer = model.model.layers[1]
    assert not any("forward" in m.__dict__ for m in layer.modules())
    assert type(layer.input_layernorm).__name__ == "LlamaRMSNorm"
    _trains_as(model, reference)
    report.revert()


def test_bound_forwards_share_one_namespace_per_modeling_file_and_replacement():
    """Each layer's copy of a forward sees the same globals (one module per modeling file
    and replacement), however many layers and models are optimized: nothing grows
    sys.modules, or torch.compile's guards, per layer."""
    import sys

    def bound() -> set[str]:
        return {name for name in sys.modules if name.startswith("xpuruntime.pytorch._bound.")}

    for _ in range(2):
        model, _reference = _pair_of("llama")
        xpt.optimize(model, POLICY).revert()
    before = bound()
    model, _reference = _pair_of("llama")
    report = xpt.optimize(model, POLICY)
    assert len(report.fused_ropes) == len(report.fused_residuals) == 2
    assert bound() == before


def test_activation_modules_and_conv1d_layers_are_recognised_by_what_they_compute():
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import Conv1D

    from xpuruntime.pytorch._optimize._probes import gelu_form, linear_kind

    forms = {name: gelu_form(ACT2FN[name]) for name in (
        "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu", "gelu_python",
        "quick_gelu", "relu", "silu",
    )}  # fmt: skip
    assert forms == {
        "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
        "gelu_accurate": "tanh", "gelu": "none", "gelu_python": "none",
        "quick_gelu": None, "relu": None, "silu": None,
    }  # fmt: skip
    assert gelu_form(torch.nn.GELU(approximate="tanh")) == "tanh"
    assert linear_kind(Conv1D(12, 8)) == "transposed"
    assert linear_kind(torch.nn.Linear(8, 12)) == "linear"
    assert linear_kind(torch.nn.Bilinear(8, 8, 12)) is None
    assert linear_kind(torch.nn.Embedding(8, 12)) is None


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_gpt2s_conv1d_mlp_runs_as_the_linear_gelu_op_unless_the_policy_names_torch(kernel):
    model, reference = _pair_of("gpt2")
    report = xpt.optimize(model, {"kernels": {**POLICY["kernels"], "linear_gelu": kernel}})
    bound = kernel != "torch"
    assert len(report.fused_gelus) == (2 if bound else 0)
    _trains_as(model, reference)
    if bound:
        from xpuruntime.pytorch._selection._routed import ROUTED_OPS

        assert [d.chosen for d in ROUTED_OPS["linear_gelu"].decisions.values()] == [kernel]
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_gpt2s_residual_norm_fuses_without_cross_attention_and_runs_as_written_with_it():
    """GPT-2's block has its cross-attention `if` between the add and the norm: the add
    and ln_2 run as one op where the `if` would not run, and as written where it runs."""
    from transformers import AutoConfig, GPT2LMHeadModel

    extra, _ = _ARCHITECTURES["gpt2"]
    config = AutoConfig.for_model("gpt2", **{**SMALL, **extra}, add_cross_attention=True)
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).to(DEVICE)
    model = GPT2LMHeadModel(config).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    report = xpt.optimize(model, POLICY)
    assert report.fused_residuals == ["transformer.h.0.ln_2", "transformer.h.1.ln_2"]
    ids, labels = _batch()
    encoded = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for extra_input in ({}, {"encoder_hidden_states": encoded}):
        for m in (model, reference):
            m.zero_grad()
        out = model(input_ids=ids, labels=labels, use_cache=False, **extra_input)
        out.loss.backward()
        want = reference(input_ids=ids, labels=labels, use_cache=False, **extra_input)
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, atol=2e-5, rtol=2e-5)
        _grads_close(model, reference, tolerance=1e-4)


@pytest.mark.parametrize("joined", [False, True], ids=["norms", "norms-with-rope"])
@pytest.mark.parametrize(("model_type", "layout"), [("qwen3", 3), ("gemma3_text", 4)])
def test_per_head_qk_norms_read_the_joined_projection_in_place(
    model_type, layout, joined, monkeypatch
):
    """Qwen3's q/k norms take (B, T, heads, D) views of the joined q/k/v projection,
    Gemma3's the same after attention's transpose: our RMSNorm reads both as grouped rows
    (no copy first), one layer's q and k norms each, and the model trains the same. Under
    ``rmsnorm_rope`` (auto) the norms run with the rope, which reads the same views."""
    import importlib

    rms = importlib.import_module("xpuruntime.pytorch._ops.fused_rmsnorm")
    norm_rope = importlib.import_module("xpuruntime.pytorch._ops.norm_rope")
    forward, launch, seen = rms.rmsnorm_forward, norm_rope._launch_forward, []

    def spied(x, *args, **kwargs):
        seen.append(x.dim())
        return forward(x, *args, **kwargs)

    def spied_launch(x, *args):
        seen.append("view" if not x.is_contiguous() else "copy")
        return launch(x, *args)

    monkeypatch.setattr(rms, "rmsnorm_forward", spied)
    monkeypatch.setattr(norm_rope, "_launch_forward", spied_launch)
    model, reference = _pair_of(model_type)
    kernels = {**POLICY["kernels"], "rmsnorm_rope": "fused" if joined else "torch"}
    report = xpt.optimize(model, {**POLICY, "kernels": kernels})
    assert len(report.fused_head_norms) == (SMALL["num_hidden_layers"] if joined else 0)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    per_head = seen.count("view") if joined else seen.count(layout)
    assert per_head == 2 * SMALL["num_hidden_layers"] and "copy" not in seen, seen
    torch.testing.assert_close(out.loss, want.loss, atol=2e-5, rtol=2e-5)
    _grads_close(model, reference, tolerance=1e-4)


def test_best_performance_times_the_fused_loss_on_the_logits_transformers_casts(materialised):
    # The timing sample stands for deferred logits: it must carry what the kernels read
    # (the head's compute dtype), or auto cannot time the fused loss at all.
    model, reference = _llama_pair()
    policy = {"kernels": {"cross_entropy": "auto"}, "auto_strategy": "best_performance"}
    xpt.optimize(model, policy)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    want = reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-5, rtol=1e-5)
    from xpuruntime.pytorch._functional._lm_head import _routed

    (decision,) = _routed.decisions.values()
    chunked = {"torch_chunked"} if hasattr(F, "linear_cross_entropy") else set()
    assert set(decision.measurements) == {"torch", "fused_linear", *chunked}


@pytest.mark.parametrize("policy", [POLICY, None], ids=["policy", "no-policy"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma3_text", "qwen3"])
def test_an_optimized_model_compiles_and_trains_the_same(model_type, policy):
    """optimize() then torch.compile, the first call under compile: our ops trace as
    registered torch ops (their kernels registered before the trace looks them up, with
    no policy too), the bound forwards (rotary attention, residual norms, GPT-2's linear +
    GELU) trace with their own globals, and the head and its loss run outside the graph,
    the logits deferred and the loss fused as in eager; no KV cache is built, traced too."""
    model, reference = _pair_of(model_type) if model_type != "llama" else _llama_pair()
    report = xpt.optimize(model, policy)
    assert report.heads_outside_the_graph == ["<model>"]
    compiled = torch.compile(model, backend="aot_eager")
    ids, labels = _batch()
    out = compiled(input_ids=ids, labels=labels)
    assert isinstance(out.logits, DeferredLogits)
    assert out.past_key_values is None  # the configs' use_cache on: none built in training
    out.loss.backward()
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, atol=1e-5, rtol=1e-5)
    _grads_close(model, reference)


def test_a_compiled_frame_taking_the_deferred_logits_copies_their_layout_and_builds_nothing(
    materialised,
):
    """A frame that dynamo compiles with the logits among its inputs (DDP's output hooks
    on a static graph's first step) copies their layout into a fake tensor; read from
    values made for it, it disagreed with the logits' own (strides 0 over one element)
    and the frame failed its own guard."""
    model, _ = _llama_pair()
    xpt.optimize(model, POLICY)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)

    @torch.compile(backend="aot_eager")
    def hooked(logits, loss):
        return loss * 2 if logits.grad_fn is not None else loss

    torch.testing.assert_close(hooked(out.logits, out.loss), out.loss * 2)
    assert out.logits.stride() == (0, 0, 0)
    assert materialised == []


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_under_fullgraph_the_compiled_graph_computes_the_logits_and_trains_the_same(model_type):
    """``fullgraph=True`` allows no graph break: the forward traces whole, the graph
    computes the logits (Gemma2's soft cap included) and the loss, as written. (Dynamo
    keeps its traces per code object, across compile calls: a forward traced before
    with breaks allowed would run split here, as traced; so none is kept.)"""
    torch._dynamo.reset()
    model, reference = _pair_of(model_type) if model_type != "llama" else _llama_pair()
    xpt.optimize(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids, labels = _batch()
    out = compiled(input_ids=ids, labels=labels)
    assert type(out.logits) is torch.Tensor
    out.loss.backward()
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-5, rtol=1e-5)
    _grads_close(model, reference)


@pytest.mark.parametrize("policy", [None, POLICY], ids=["auto", "named"])
def test_under_compile_auto_leaves_the_norms_rope_and_swiglu_to_inductor(policy):
    """Inside a torch.compile trace ``auto`` means torch's form of the norms, rope and
    SwiGLU (inductor fuses it with the code around it); a policy naming our fused kernels
    keeps them in the graph as our registered ops. (Dynamo keeps its traces per code
    object across compile calls, and the backend below records only what it is handed:
    so none is kept from the tests a process ran before. One full run failed without
    this, the named case's graph holding none of our ops.)"""
    torch._dynamo.reset()
    model, _ = _llama_pair()
    xpt.optimize(model, policy)
    traced = set()

    def backend(graph, inputs):
        traced.update(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    ids, labels = _batch()
    torch.compile(model, backend=backend)(input_ids=ids, labels=labels)
    ours = {name for name in traced if name.startswith("xpuruntime.")}
    elementwise = {
        f"xpuruntime.{op}.default" for op in ("rms_norm", "add_rms_norm", "swiglu", "rope")
    }
    if policy is None:
        assert not ours & elementwise, ours
    else:
        assert elementwise <= ours, ours


def test_a_training_forward_builds_no_kv_cache_unless_the_call_asks_for_one():
    """transformers builds a KV cache in every forward while ``config.use_cache`` is on,
    training ones included: the optimized model's training forward with gradients builds
    none (the report says so), with the same loss and gradients; a call passing
    ``use_cache=True``, an eval forward and one without gradients still get one; a
    peft-wrapped model too; revert gives the model its caches back; nothing is said once
    the config turns caches off."""
    model, reference = _llama_pair()
    report = xpt.optimize(model)
    assert report.kv_caches_in_training == ["<model>"]
    assert "turned off 1 KV cache(s) in training forwards" in str(report).splitlines()[0]
    ids, labels = _batch()
    ours, theirs = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert ours.past_key_values is None and theirs.past_key_values is not None
    torch.testing.assert_close(ours.loss, theirs.loss, atol=2e-5, rtol=2e-5)
    ours.loss.backward()
    theirs.loss.backward()
    for mine, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, want.grad, atol=2e-5, rtol=2e-5)
    assert model(input_ids=ids, use_cache=True).past_key_values is not None
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None
    model.eval()
    assert model(input_ids=ids).past_key_values is not None
    model.train()
    report.revert()
    assert model(input_ids=ids).past_key_values is not None
    model.config.use_cache = False
    report = xpt.optimize(model)
    assert report.kv_caches_in_training == [] and "KV cache" not in str(report)
    report.revert()
    peft = pytest.importorskip("peft")
    model.config.use_cache = True
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear"))
    assert xpt.optimize(wrapped).kv_caches_in_training == ["<model>"]
    assert wrapped(input_ids=ids, labels=labels).past_key_values is None


def test_packed_documents_stay_apart_though_the_config_leaves_caches_on():
    """With a cache, transformers does not look for packed sequences in ``position_ids``
    (its documents would attend to each other). The optimized model's training forward
    builds none, so a padding-free row's loss is the one transformers computes without a
    cache, from documents apart."""
    model, reference = _llama_pair()
    xpt.optimize(model)
    ids, positions = _packed_batch()
    labels = ids.clone()
    ours = model(input_ids=ids, labels=labels, position_ids=positions)
    want = reference(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    torch.testing.assert_close(ours.loss, want.loss, atol=2e-5, rtol=2e-5)


def _packed_batch(lengths=(5, 1, 9, 17)):
    """One row of documents (TRL's padding-free batch): ids, and positions restarting at
    each document."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    ids = torch.randint(3, 96, positions.shape, generator=torch.Generator().manual_seed(3))
    return ids.to(DEVICE), positions


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_packed_batch_attends_within_its_documents_on_our_kernel_as_transformers_masks(
    model_type, monkeypatch
):
    """A packed row (positions restarting per document, use_cache off): the optimized
    model keeps transformers' block-diagonal mask as its documents and runs SDPA on our
    kernel within each, never building the mask; loss and gradients are transformers'
    own on its mask (float64 reference); the report says so."""
    from transformers import masking_utils

    from xpuruntime.pytorch._functional import _documents
    from xpuruntime.pytorch._functional._documents import DocumentMask

    monkeypatch.setattr(_documents, "_warned", set())  # each reason warned in this test
    from xpuruntime.pytorch._ops import flash_attention as fa

    bounded, bounds = [], fa.document_bounds
    monkeypatch.setattr(fa, "document_bounds", lambda *a: bounded.append(1) or bounds(*a))
    key_heads, attend = [], fa.attention
    monkeypatch.setattr(
        fa, "attention", lambda q, k, *a: key_heads.append(k.shape[1]) or attend(q, k, *a)
    )

    # Heads of 16: our kernel takes head dims 16 to 128 (the tiny configs' 8 it refuses,
    # and SDPA then runs on transformers' mask: the last lines).
    model, reference = _half_and_float64(model_type)
    config = model.config
    report = xpt.optimize(model)
    assert report.packed_masks_as_documents == ["model"]
    assert "1 packed-sequence mask(s) to our document attention" in str(report).splitlines()[0]
    ids, positions = _packed_batch()
    built, sdpa = [], masking_utils.sdpa_mask
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(1) or sdpa(*a, **k))
        patch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                      masking_utils.sdpa_mask)  # fmt: skip
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        assert built == []  # the mask was never made
        assert bounded == [1]  # the documents' bounds made once, for every layer
        # Grouped key and value heads as the model holds them, not repeated copies.
        assert key_heads == [config.num_key_value_heads] * config.num_hidden_layers
        want = reference(input_ids=ids, labels=ids, position_ids=positions).loss
        assert built == [1]  # transformers' own, on the reference
    loss.backward()
    want.backward()
    # Attending across the documents moves this loss by 0.017: the bound is far below.
    torch.testing.assert_close(loss.double(), want.double(), atol=1e-3, rtol=0)
    _assert_gradients_near(model, reference)
    # Where our kernel does not take the call (fp32 here), SDPA runs on transformers'
    # mask, and a warning says why.
    model.float()
    with pytest.MonkeyPatch.context() as patch, pytest.warns(UserWarning, match="fp16 or bf16"):
        made = []
        patch.setattr(DocumentMask, "materialize", lambda m, f=DocumentMask.materialize: (
            made.append(1) or f(m)))  # fmt: skip
        fp32 = model(input_ids=ids, labels=ids, position_ids=positions).loss
    assert made and torch.allclose(fp32.double(), want.double(), atol=1e-4, rtol=1e-4)
    # A policy set afterwards that names another attention kernel is followed too.
    model.half()
    xpt.set_kernel_policy({"kernels": {"attention": "math"}})
    with pytest.warns(UserWarning, match="names attention 'math'"):
        named = model(input_ids=ids, labels=ids, position_ids=positions).loss
    torch.testing.assert_close(named.double(), want.double(), atol=1e-3, rtol=0)


def test_under_packed_sequences_a_packed_batch_finds_its_documents_with_no_host_read(
    monkeypatch,
):
    """The policy's ``packed_sequences``: every batch given positions is read as packed,
    its documents made on the device. transformers' look at the positions (a host read in
    every forward) is gone, and the loss and gradients are still transformers' own on its
    block-diagonal mask; a batch that is not packed computes plain causal attention."""

    from xpuruntime import PolicyError, policies
    from xpuruntime.pytorch._functional import _documents

    monkeypatch.setattr(_documents, "_warned", set())  # each reason warned in this test
    model, reference = _half_and_float64("llama")
    policy = policies.KernelPolicy(packed_sequences=True)
    assert policies.KernelPolicy.from_dict(policy.to_dict()) == policy
    assert policy.to_dict()["packed_sequences"] is True
    with pytest.raises(PolicyError, match="packed_sequences: expected True or False"):
        policies.KernelPolicy(packed_sequences="yes")
    report = xpt.optimize(model, policy)
    assert report.packed_positions_read_on_device == ["model"]
    assert "read 1 model(s)' positions as packed documents" in str(report).splitlines()[0]
    ids, positions = _packed_batch()
    plain = torch.arange(ids.shape[1], device=DEVICE)[None]
    for given in (positions, plain):
        _packed_step_reads_nothing_and_matches(model, reference, ids, given)
    # Where our kernel does not take a call (fp32), SDPA runs on the mask made on the
    # device from the same documents: transformers' mask.
    model.float()
    with pytest.warns(UserWarning, match="fp16 or bf16"):
        fp32 = model(input_ids=ids, labels=ids, position_ids=positions).loss
    want = reference(input_ids=ids, labels=ids, position_ids=positions).loss
    torch.testing.assert_close(fp32.double(), want.double(), atol=1e-4, rtol=1e-4)


def test_under_packed_sequences_rows_packed_differently_in_one_batch_stay_apart():
    """Two rows, one of four documents and one of a single document: each row's
    documents made on the device (no host read), the logits transformers' own."""
    model, reference = _half_and_float64("llama")
    xpt.optimize(model, {"packed_sequences": True})
    rows = [(5, 1, 9, 17), (32,)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    ids = torch.randint(3, 96, positions.shape, generator=torch.Generator().manual_seed(3))
    ids, positions = ids.to(DEVICE), positions.to(DEVICE)
    with host_reads() as reads:
        logits = model(input_ids=ids, position_ids=positions).logits
    assert reads == []
    want = reference(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(logits.double(), want, atol=2e-3, rtol=0)


def test_under_packed_sequences_a_checkpointed_model_recomputes_within_its_documents():
    """transformers' gradient checkpointing (non-reentrant) runs each layer again in the
    backward: the documents hold there too, with no host read."""
    model, reference = _half_and_float64("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    report = xpt.optimize(model, {"packed_sequences": True})
    assert report.packed_positions_read_on_device == ["model"]
    _packed_step_reads_nothing_and_matches(model, reference, *_packed_batch())


def test_under_packed_sequences_threads_calling_at_once_each_get_their_own_documents():
    """Three threads call one model at once with rows packed three ways, and positions
    held as users hold them (an expanded view, int32, strided): each gets transformers'
    logits for its own documents."""
    import threading

    model, reference = _half_and_float64("llama")
    xpt.optimize(model, {"packed_sequences": True})
    row = torch.cat([torch.arange(n) for n in (5, 1, 9, 17)])
    given = {
        "expanded": row[None].expand(2, -1),
        "int32": torch.cat([torch.arange(16), torch.arange(16)])[None].to(torch.int32),
        "strided": torch.stack([torch.arange(32)] * 2, 1).T[:1],
    }
    ids = torch.randint(3, 96, (2, 32), generator=torch.Generator().manual_seed(3))
    got, failed = {}, []

    def call(name):
        try:
            positions = given[name].to(DEVICE)
            with torch.no_grad():
                for _ in range(3):
                    got[name] = model(input_ids=ids[: len(positions)].to(DEVICE),
                                      position_ids=positions).logits  # fmt: skip
        except Exception as error:  # (a thread's failure, raised below)
            failed.append(error)

    threads = [threading.Thread(target=call, args=(name,)) for name in given]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failed == []
    for name, positions in given.items():
        rows = ids[: len(positions)].to(DEVICE)
        want = reference(input_ids=rows, position_ids=positions.long().to(DEVICE)).logits
        torch.testing.assert_close(got[name].double(), want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_under_packed_sequences_other_families_find_their_documents_with_no_host_read(
    model_type, monkeypatch
):
    """Qwen3 (q/k norms) and Gemma3 (a full layer between sliding ones of window 8):
    their packed rows read nothing back and train as transformers' own."""
    from xpuruntime.pytorch._functional import _documents

    monkeypatch.setattr(_documents, "_warned", set())
    layers = {"num_hidden_layers": 3, "sliding_window": 8}
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    if model_type == "gemma3_text":
        layers["layer_types"] = kinds
    model, reference = _half_and_float64(model_type, **layers)
    assert (model.config.layer_types == kinds) is (model_type == "gemma3_text")
    report = xpt.optimize(model, {"packed_sequences": True})
    assert report.packed_positions_read_on_device == ["model"]
    _packed_step_reads_nothing_and_matches(model, reference, *_packed_batch())


@pytest.mark.parametrize(
    "model_type, head_dim, window",
    [("mistral", 16, 8), ("mistral", 16, 64), ("gemma3_text", 256, 8)],
    ids=["window-inside-documents", "window-over-all", "gemma-heads-of-256"],
)
def test_under_packed_sequences_a_sliding_window_model_finds_its_documents_with_no_host_read(
    model_type, head_dim, window, monkeypatch
):
    """Mistral's (Gemma3's) layers build transformers' sliding-window mask. Under
    ``packed_sequences`` it is made on the device from the same documents: within them
    and the window, for our kernel (no dense mask, where the window cuts a document
    too), with no host read, and transformers' loss and gradients."""

    from xpuruntime.pytorch._functional import _documents
    from xpuruntime.pytorch._optimize.patterns import causal_mask

    monkeypatch.setattr(_documents, "_warned", set())
    dense = []  # the masks made dense: only where the window cuts a document
    within = causal_mask._causal_within
    monkeypatch.setattr(causal_mask, "_causal_within",
                        lambda *args: dense.append(args[1:]) or within(*args))  # fmt: skip
    model, reference = _half_and_float64(model_type, sliding_window=window, head_dim=head_dim)
    report = xpt.optimize(model, {"packed_sequences": True})
    assert report.packed_positions_read_on_device == ["model"]
    _packed_step_reads_nothing_and_matches(model, reference, *_packed_batch())
    assert dense == []


@pytest.mark.parametrize(
    "model_type, head_dim", [("mistral", 16), ("qwen2", 16), ("gemma3_text", 256)]
)
def test_a_sliding_window_shorter_than_the_call_runs_on_our_kernel_within_the_window(
    model_type, head_dim, monkeypatch
):
    """A plain batch longer than the config's sliding window: transformers would hand
    SDPA a dense (B, 1, T, T) mask for each sliding layer. Here no mask is built: our
    kernel reads the window and skips the keys outside it, with no host read, and the
    loss and gradients are transformers' own on its masks (float64 reference). A model
    whose window covers the call, and heads our kernel does not take, get what
    transformers builds."""
    from xpuruntime.pytorch._functional import _documents
    from xpuruntime.pytorch._functional._documents import DocumentMask
    from xpuruntime.pytorch._ops import flash_attention as fa

    monkeypatch.setattr(_documents, "_warned", set())
    windows, attend = [], fa.attention
    monkeypatch.setattr(fa, "attention", lambda *a: windows.append(a[-1]) or attend(*a))
    extra = {"use_sliding_window": True, "max_window_layers": 0} if model_type == "qwen2" else {}
    model, reference = _half_and_float64(
        model_type, sliding_window=5, head_dim=head_dim, **extra
    )  # (Gemma3's first five layers slide: both of these)
    xpt.optimize(model)
    ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    built = []
    with pytest.MonkeyPatch.context() as patch, host_reads() as reads:
        patch.setattr(DocumentMask, "materialize", lambda mask: built.append(mask))
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
    assert reads == [] and built == []
    assert len(windows) == model.config.num_hidden_layers  # every layer's on our kernel
    starts, _ = windows[0]
    assert starts[0, -1].item() == 23 - 5  # the last query sees its last 5 keys
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.double(), atol=1e-3, rtol=0)
    _assert_gradients_near(model, reference)
    # Heads of 80, which our kernel does not take: transformers' mask, built as it builds
    # it, and no warning.
    wide, _ = _half_and_float64(model_type, sliding_window=5, head_dim=80, **extra)
    xpt.optimize(wide)
    windows.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        wide(input_ids=ids, labels=ids).loss.backward()
    assert windows == []


def test_a_mask_of_ones_keeps_the_window_on_our_kernel_and_padding_keeps_transformers_mask(
    monkeypatch,
):
    """Collators pass an attention mask even where no row is padded (all ones): the
    sliding layers still run the window on our kernel, with transformers' loss and
    gradients. A padded row's mask is transformers' to build, as before."""
    from xpuruntime.pytorch._ops import flash_attention as fa

    windows, attend = [], fa.attention
    monkeypatch.setattr(fa, "attention", lambda *a: windows.append(a[-1]) or attend(*a))
    model, reference = _half_and_float64("mistral", sliding_window=5)
    xpt.optimize(model)
    ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ones = torch.ones_like(ids)
    loss = model(input_ids=ids, attention_mask=ones, labels=ids).loss
    loss.backward()
    assert len(windows) == model.config.num_hidden_layers
    want = reference(input_ids=ids, attention_mask=ones, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.double(), atol=1e-3, rtol=0)
    _assert_gradients_near(model, reference)
    windows.clear()
    padded = ones.clone()
    padded[1, 19:] = 0  # the second row's last four tokens are padding
    got = model(input_ids=ids, attention_mask=padded, labels=ids).loss
    assert windows == []  # transformers' mask, padding and window in it
    want = reference(input_ids=ids, attention_mask=padded, labels=ids).loss
    torch.testing.assert_close(got.double(), want.detach().double(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("model_type, head_dim", [("mistral", 16), ("gemma3_text", 256)])
def test_generate_over_a_prompt_longer_than_the_window_gives_the_models_tokens(
    model_type, head_dim, monkeypatch
):
    """generate's prefill (an empty cache) runs the sliding layers on our kernel with the
    window; the decoding steps after it read the cache as transformers does (Gemma3's
    sliding layers a cache of the window's length). Greedy tokens are the unoptimized
    model's."""
    from xpuruntime.pytorch._ops import flash_attention as fa

    windows, attend = [], fa.attention
    monkeypatch.setattr(fa, "attention", lambda *a: windows.append(a[-1]) or attend(*a))
    model, _ = _half_and_float64(model_type, sliding_window=6, head_dim=head_dim, use_cache=True)
    reference = copy.deepcopy(model).eval()
    xpt.optimize(model.eval())
    ids = torch.randint(3, 96, (1, 15), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = reference.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert len(windows) == model.config.num_hidden_layers  # the prefill's layers alone


def _half_and_float64(model_type: str, **overrides):
    """A tiny ``model_type`` (heads of 16, no cache) in fp16, and a float64 copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**SMALL, "head_dim": 16, "use_cache": False, **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).to(DEVICE).double()
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    return model.half(), reference


def _packed_step_reads_nothing_and_matches(model, reference, ids, positions) -> None:
    """A forward and backward of ``model`` over ``positions`` reads nothing back to the
    host (transformers' look at the positions, and ours, each would) and runs attention
    within the documents on our kernel (no mask built for it), and its loss and
    gradients are ``reference``'s (transformers' own masks, float64)."""
    from xpuruntime.pytorch._functional._documents import DocumentMask

    built = []
    with pytest.MonkeyPatch.context() as patch, host_reads() as reads:
        patch.setattr(DocumentMask, "materialize", lambda mask: built.append(mask))
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
    assert reads == [] and built == []
    reference.zero_grad()
    want = reference(input_ids=ids, labels=ids, position_ids=positions).loss
    want.backward()
    torch.testing.assert_close(loss.double(), want.double(), atol=1e-3, rtol=0)
    _assert_gradients_near(model, reference)
    model.zero_grad()


def _assert_gradients_near(model, reference) -> None:
    """Each of ``model``'s gradients within 2% of the float64 ``reference``'s largest."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        scale = q.grad.abs().max().clamp(min=1e-3)
        assert (p.grad.double() - q.grad).abs().max() / scale < 2e-2, name


def test_packed_sequences_under_another_attention_kernel_hands_it_the_mask_made_on_device():
    """With attention named elsewhere (cuDNN, math) our kernel does not read the
    documents: SDPA gets the block-diagonal mask, made from them on the device, with no
    host read (a graphed step can still capture packed rows), and transformers' loss."""
    model, reference = _half_and_float64("llama")
    report = xpt.optimize(model, {"packed_sequences": True, "kernels": {"attention": "math"}})
    assert report.packed_positions_read_on_device == ["model"]
    assert report.packed_masks_as_documents == []
    assert not any("packed_sequences" in why for _, why in report.skipped)
    _packed_step_reads_nothing_and_matches(model, reference, *_packed_batch())


def test_a_packed_call_our_kernel_declines_runs_sdpa_on_repeated_heads_as_transformers_would(
    monkeypatch,
):
    """transformers hands SDPA grouped key heads with ``enable_gqa`` where the mask is
    our DocumentMask; where our kernel does not take the call (fp32 here), SDPA runs on
    the built mask with the heads repeated, as transformers hands them with any other
    mask (SDPA's fused kernels on CUDA take grouped heads only without a mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from xpuruntime.pytorch._functional import _documents
    from xpuruntime.pytorch._functional._documents import DocumentMask

    monkeypatch.setattr(_documents, "_warned", set())
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], device=DEVICE)
    same = documents[:, None, :, None] == documents[:, None, None, :]
    causal = torch.ones(8, 8, dtype=torch.bool, device=DEVICE).tril()
    built = same & causal
    query = torch.randn(1, 4, 8, 16, device=DEVICE)
    key, value = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(2))
    heads = []

    class KeyHeads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                heads.append(args[1].shape[1])
            return func(*args, **(kwargs or {}))

    mask = DocumentMask(documents, lambda: built)
    with pytest.warns(UserWarning, match="fp16 or bf16"), KeyHeads():
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=True
        )
    assert heads and set(heads) == {4}
    repeated = (t.repeat_interleave(2, dim=1) for t in (key, value))
    want = torch.nn.functional.scaled_dot_product_attention(query, *repeated, attn_mask=built)
    torch.testing.assert_close(out, want)


def test_under_compile_a_plain_causal_mask_is_left_to_sdpa_and_any_other_is_built():
    """transformers before torch 2.14 materialises the causal mask whenever dynamo
    traces; the optimized model's forward leaves it to SDPA's is_causal where eager
    transformers would (no padding, an empty dynamic cache, or no cache and positions the
    model made itself), and builds every other."""
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache

    from xpuruntime.pytorch._optimize.patterns.causal_mask import _mask_builder

    model, _ = _llama_pair()
    report = xpt.optimize(model)
    assert report.causal_masks_left_to_sdpa == ["model"]
    assert "left 1 causal mask(s)" in str(report).splitlines()[0]
    config, mask = model.config, _mask_builder(masking_utils.create_causal_mask)
    embeds = torch.randn(2, 12, 32, device=DEVICE)
    padded = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    padded[0, :3] = 0
    positions = torch.arange(12, device=DEVICE)[None]

    named = cache_argument(masking_utils.create_causal_mask)

    def built(attention_mask, cache, position_ids=None) -> bool:
        @torch.compile(backend="eager")
        def traced(embeds):
            made = mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                        position_ids=position_ids, **{named: cache})  # fmt: skip
            return embeds if made is None else made

        return traced(embeds) is not embeds and traced(embeds).dim() == 4

    assert not built(None, DynamicCache(config=config))  # plain causal: left to SDPA
    assert built(padded, DynamicCache(config=config))  # padding: a mask
    assert built(None, None, positions)  # packed sequences are looked for: a mask
    # The model's own positions (the caller gave none): nothing packed to look for.
    mask = _mask_builder(masking_utils.create_causal_mask, True, False, True)
    assert not built(None, None, positions)
    assert built(padded, None, positions)
    report.revert()
    assert "forward" not in model.model.__dict__


def test_under_compile_packed_sequences_leaves_a_packed_batch_to_transformers_own_mask():
    """A trace cannot hold the documents' mask object: under torch.compile the policy's
    ``packed_sequences`` builds transformers' own block-diagonal mask, as without it."""
    from transformers import masking_utils

    from xpuruntime.pytorch._optimize.patterns.causal_mask import _mask_builder

    model, _ = _llama_pair()
    config = model.config
    mask = _mask_builder(masking_utils.create_causal_mask, True, True, False, True)
    embeds = torch.randn(1, 12, 32, device=DEVICE)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]], device=DEVICE)
    cache = cache_argument(masking_utils.create_causal_mask)
    arguments = {"config": config, "attention_mask": None, cache: None,
                 "position_ids": positions}  # fmt: skip

    @torch.compile(backend="eager")
    def traced(embeds):
        return mask(inputs_embeds=embeds, **arguments)

    made = traced(embeds)
    want = masking_utils.create_causal_mask(inputs_embeds=embeds, **arguments)
    assert type(made) is torch.Tensor and torch.equal(made, want)


@pytest.mark.parametrize("window, left", [(32, True), (8, False)], ids=["covers", "narrower"])
def test_under_compile_a_sliding_window_that_takes_in_every_key_is_left_to_sdpa(window, left):
    """Gemma3's default window (4096) takes in every key at T2048: eager transformers
    then leaves its sliding layers' masks out, and under compile so does the optimized
    model (cuDNN's attention on the 22 masks took 27 ms a step against 10 on an H100);
    a narrower window's mask is built, and the loss is the model's either way."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    seen = []
    sdpa = F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        seen.append(kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    config = Gemma3TextConfig(**{**SMALL, "sliding_window": window, "num_hidden_layers": 6})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(DEVICE)
    reference = Gemma3ForCausalLM(config).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    xpt.optimize(model)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), device=DEVICE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", recorded)
        loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    assert len(seen) == 6 and all(seen[-1:])  # the last layer attends fully
    assert all(seen) is left
    torch.testing.assert_close(
        loss, reference(input_ids=ids, labels=ids).loss, atol=1e-5, rtol=1e-5
    )


def test_the_mask_is_read_the_same_where_transformers_names_its_cache_past_key_values():
    """transformers up to 5.17 at least names create_causal_mask's cache argument
    ``past_key_values`` (5.24: ``cache``): a packed batch's mask is still kept as its
    documents, and under compile a plain causal one still left to SDPA."""
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache

    from xpuruntime.pytorch._functional._documents import DocumentMask
    from xpuruntime.pytorch._optimize.patterns.causal_mask import _mask_builder

    def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values,
                           position_ids=None):  # fmt: skip
        return masking_utils.create_causal_mask(
            config, inputs_embeds, attention_mask, past_key_values, position_ids
        )

    model, _ = _llama_pair()
    config, mask = model.config, _mask_builder(create_causal_mask, True, True)
    embeds = torch.randn(1, 12, 32, device=DEVICE)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].to(DEVICE)
    packed = mask(config, embeds, None, past_key_values=None, position_ids=positions)
    assert isinstance(packed, DocumentMask)
    assert packed.documents.tolist() == [[0] * 5 + [1] * 7]
    cached = mask(config, embeds, None, DynamicCache(config=config), positions)
    assert cached is None  # with a cache transformers looks for no documents: causal

    @torch.compile(backend="eager")
    def traced(embeds):
        made = mask(config, embeds, None, past_key_values=DynamicCache(config=config))
        return embeds if made is None else made

    assert traced(embeds) is embeds  # plain causal: left to SDPA


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_fusions_and_trains_as_the_unoptimized_model(
    reentrant, monkeypatch
):
    """transformers' gradient checkpointing re-runs each layer's forward in the backward;
    the non-reentrant kind requires the recompute to save what the forward saved. Two
    steps, so that each signature's later calls (a launch plan's, on a GPU) run too."""
    from xpuruntime.pytorch._functional import _norms

    calls = []
    routed = _norms._rms_norm
    monkeypatch.setattr(_norms, "_rms_norm", lambda *a: calls.append(1) or routed(*a))
    model, reference = _llama_pair()
    kwargs = {"use_reentrant": reentrant}
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        m.train()
    report = xpt.optimize(model, POLICY)
    assert report.fused_swiglus and report.joined_projections
    for _ in range(2):
        model.zero_grad(), reference.zero_grad()
        _trains_as(model, reference)
    assert calls  # the norms ran as our op, recomputed segments included


def test_a_trainer_run_on_an_optimized_model_trains_as_the_unoptimized_one(materialised, tmp_path):
    """transformers' Trainer (its own loss path, num_items_in_batch counted by its
    identity test on the model's loss function, gradient accumulation): three steps
    give the unoptimized model's losses and weights, and never build the logits."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(i))
            labels = ids.clone()
            labels[: i % 4] = -100  # rows with different counts of ignored positions
            return {"input_ids": ids, "labels": labels}

    model, reference = _llama_pair()
    xpt.optimize(model, POLICY)
    losses = {}
    for name, m in (("optimized", model), ("reference", reference)):
        args = TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3,
            gradient_accumulation_steps=2, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=DEVICE == "cpu", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=m, args=args, train_dataset=Batches())
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert materialised == []
    assert len(losses["optimized"]) == 3
    assert losses["optimized"] == pytest.approx(losses["reference"], rel=1e-5, abs=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


# -- what a graphed step prepares for a transformers model ---------------------------------
@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3", "gpt_oss", "llama"])
def test_a_graphed_step_builds_mixed_attention_masks_before_capture_and_trains_the_same(
    model_type,
):
    """Models whose layers take masks of several kinds (Gemma 3's sliding and full
    attention) are called with the masks transformers builds for ``generate``, made
    once for the batch's shape, and no KV cache: the loss and every gradient are the
    model's own, and the forward reads nothing back to the host (the model's own
    forward without a cache looks for packed sequences by reading a value back).
    Models whose layers are all alike keep their own call."""
    from xpuruntime.pytorch._training._transformers import prepared_forward

    model, reference = _pair_of(model_type) if model_type != "llama" else _llama_pair()
    xpt.optimize(model, POLICY)
    ids, _ = _batch()
    prepared = prepared_forward(model, (ids,))
    if model_type == "llama":
        assert prepared is None
        return
    assert prepared is not None and "KV cache off" in prepared.describe()
    assert set(prepared.masks) == set(model.config.layer_types)

    def loss_of(forward):
        logits = forward(ids).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    assert prepared.agrees(loss_of)
    with host_reads() as reads:
        loss = loss_of(prepared)
    assert reads == []
    loss.backward()
    with host_reads() as reads:
        want = loss_of(lambda x: reference(x, use_cache=False))
    if model_type == "gemma3_text":
        assert reads  # what the prepared call avoids
    want.backward()
    torch.testing.assert_close(loss, want, atol=2e-5, rtol=2e-5)
    _grads_close(model, reference, tolerance=1e-4)


def test_a_graphed_step_of_a_mapping_batch_builds_the_masks_before_capture_and_trains_the_same():
    """A batch as a transformers loop holds it (``input_ids`` and ``labels``, the model's
    own loss) gets the masks built before capture too; one with a padding mask is
    called as it is."""
    from xpuruntime.pytorch._training._transformers import prepared_forward

    model, reference = _pair_of("gemma3_text")
    xpt.optimize(model, POLICY)
    ids, labels = _batch()
    batch = {"input_ids": ids, "labels": labels}
    prepared = prepared_forward(model, batch)
    assert prepared is not None and "KV cache off" in prepared.describe()
    assert prepared_forward(model, {**batch, "attention_mask": torch.ones_like(ids)}) is None
    assert prepared.agrees(lambda forward: forward(**batch).loss)
    with host_reads() as reads:
        loss = prepared(**batch).loss
    assert reads == []
    loss.backward()
    want = reference(**batch, use_cache=False).loss
    want.backward()
    torch.testing.assert_close(loss, want, atol=2e-5, rtol=2e-5)
    _grads_close(model, reference, tolerance=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_model_making_its_own_positions_builds_its_masks_without_reading_them(
    model_type, monkeypatch
):
    """Without a cache transformers reads the positions to look for packed sequences, a
    host sync in every forward: called without positions, the optimized model does not
    read the ones it makes (an arange) and trains as the unoptimized one; positions the
    caller gives are read once per mask, not twice."""
    from transformers import masking_utils

    read = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(
        masking_utils, "find_packed_sequence_indices", lambda p: read.append(p.shape) or real(p)
    )
    model, reference = _pair_of(model_type)
    report = xpt.optimize(model)
    (line,) = report.host_syncs_removed
    assert line.startswith("model: its masks built without reading the positions")
    assert "removed 1 host sync(s)" in str(report).splitlines()[0]
    _trains_as(model, reference)  # use_cache off: the reference reads its positions
    assert read == [torch.Size([2, 12])] * (2 if model_type == "gemma3_text" else 1)
    read.clear()
    positions = torch.arange(12, device=DEVICE)[None].expand(2, -1)
    ids, labels = _batch()
    given = model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    assert len(read) == (2 if model_type == "gemma3_text" else 1)  # one per mask
    torch.testing.assert_close(given.loss, reference(input_ids=ids, labels=labels).loss)
    report.revert()
    assert "forward" not in model.model.__dict__


def test_a_model_making_its_own_positions_compiles_without_a_cache_and_trains_the_same():
    """Under torch.compile, without a cache: the forward picked for a call without
    positions traces, its full-attention mask left to SDPA's is_causal (a trace cannot
    read the positions; transformers would build the mask), and the model trains as
    the unoptimized one; given positions take the other forward."""
    model, reference = _llama_pair()
    xpt.optimize(model)
    compiled = torch.compile(model, backend="aot_eager")
    want = _trains_as(compiled, reference, tolerances=(1e-5, 1e-5))
    ids, labels = _batch()
    positions = torch.arange(12, device=DEVICE)[None].expand(2, -1)
    given = compiled(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    torch.testing.assert_close(given.loss, want, atol=1e-5, rtol=1e-5)


def test_a_training_cache_gets_its_sliding_windows_made_on_the_models_device():
    """transformers copies each sliding layer's window size from the host in every
    forward that builds a cache (a stream sync each): the optimized Gemma 3's cache holds
    them made on the device, the same sizes, and the model's outputs are unchanged."""
    model, reference = _pair_of("gemma3_text")
    report = xpt.optimize(model)
    (line,) = report.host_syncs_removed
    assert "its KV cache's sliding-window sizes made on the device" in line
    ids, labels = _batch()
    ours = model(input_ids=ids, labels=labels, use_cache=True)
    theirs = reference(input_ids=ids, labels=labels, use_cache=True)
    ours_cache, their_cache = output_cache(ours), output_cache(theirs)
    windows = [getattr(layer, "_sliding_window_tensor", None) for layer in ours_cache.layers]
    want = [getattr(layer, "_sliding_window_tensor", None) for layer in their_cache.layers]
    assert windows[0] is not None and windows[1] is None  # sliding, then full attention
    assert windows[0].device.type == torch.device(DEVICE).type
    assert int(windows[0]) == int(want[0])
    again = output_cache(model(input_ids=ids, use_cache=True)).layers[0]._sliding_window_tensor
    assert again is windows[0]  # made once on the device, not copied in each forward
    torch.testing.assert_close(ours.loss, theirs.loss, atol=2e-5, rtol=2e-5)
    for mine, other in zip(ours_cache.layers, their_cache.layers):
        torch.testing.assert_close(mine.keys, other.keys, atol=2e-5, rtol=2e-5)
    plain, _ = _pair_of("llama")  # no sliding layers: its cache left as transformers makes it
    (line,) = xpt.optimize(plain).host_syncs_removed
    assert "sliding" not in line


@pytest.mark.parametrize("model_type", sorted(_ARCHITECTURES))
def test_an_optimized_model_reads_no_value_back_where_the_model_as_written_does(model_type):
    """Every family: a training forward and backward of the optimized model reads no more
    values back to the host than the model as written (each read waits for the GPU
    there), and none without a cache, where transformers reads the positions once per
    mask to look for packed sequences."""
    model, reference = _pair_of(model_type)
    xpt.optimize(model)
    ids, labels = _batch()
    counts = {}
    for name, m in (("ours", model), ("theirs", reference)):
        for use_cache in (None, False):
            with host_reads() as reads:
                m(input_ids=ids, labels=labels, use_cache=use_cache).loss.backward()
            counts[name, use_cache] = len(reads)
    assert counts["ours", None] <= counts["theirs", None], counts
    assert counts["ours", False] <= counts["theirs", False], counts
    if model_type != "gpt2":  # it reads one more value as written
        assert counts["ours", False] == 0, counts


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_peft_model_checkpointed_reads_no_value_back_either(model_type):
    """peft LoRA on every linear layer, gradient checkpointing on (transformers then
    builds no cache, and reads the positions once per mask): the optimized step reads
    none."""
    peft = pytest.importorskip("peft")
    counts = []
    for optimized in (True, False):
        model, _ = _pair_of(model_type)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        if optimized:
            xpt.optimize(model)
        ids, labels = _batch()
        with host_reads() as reads:
            model(input_ids=ids, labels=labels).loss.backward()
        counts.append(len(reads))
    assert counts[0] == 0 and counts[1] > 0, counts


def _waits(model, use_cache: bool | None = None) -> int:
    """How many times a training step of ``model`` (after two to warm up) waits for the
    GPU, by PyTorch's sync-debug warnings."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    ids, labels = _batch()

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=labels, use_cache=use_cache).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (the first call of set_sync_debug_mode warns that it is a prototype: not counted)
    return sum("called a synchronizing" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_an_optimized_training_step_never_waits_for_the_gpu(model_type, use_cache):
    """A wait for the GPU in the step stops the host queueing work ahead of it (Gemma3-1B
    on an H100: 164-172 ms a step with transformers' packed-sequence reads, 137-140 ms
    without): after a warm-up, a step of the optimized model makes none, where the
    unoptimized model makes 2 (Llama without a cache) or 22 (Gemma3-1B with one)."""
    model, _ = _pair_of(model_type)
    xpt.optimize(model)
    assert _waits(model, use_cache) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(_ARCHITECTURES))
def test_an_optimized_step_waits_for_the_gpu_no_more_than_the_models_own(model_type):
    """Every family, as its config comes (use_cache on): the optimized step adds no wait
    for the GPU to those of the model as written (routed experts read their routing)."""
    model, reference = _pair_of(model_type)
    xpt.optimize(model)
    ours, theirs = _waits(model), _waits(reference)
    print(f"{model_type}: waits ours {ours}, as written {theirs}")
    assert ours <= theirs


def test_a_model_whose_own_masks_differ_is_called_as_it_is():
    """A forward that overlays a mask of its own (here: a bidirectional Gemma 3) is not
    given the masks built for ``generate``."""
    from xpuruntime.pytorch._training._transformers import prepared_forward

    model, _ = _pair_of("gemma3_text")
    model.config.use_bidirectional_attention = True
    ids, _ = _batch()
    assert prepared_forward(model, ids) is None


@pytest.mark.gpu
def test_a_graphed_step_of_gemma3_captures_and_follows_the_eager_step():
    """Gemma 3's training forward builds a KV cache whose sliding layers copy a host
    tensor to the device: the graphed step calls it with masks built before capture and
    no cache, and replays the eager step's losses."""
    model, reference = _pair_of("gemma3_text")
    ids, _ = _batch()
    batches = [(ids.roll(i, 1), ids.roll(i, 1)) for i in range(3)]

    def loss_fn(output, labels):
        logits = output.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    policy = {**POLICY, "cuda_graph": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step, _ = xpt.make_train_step(model, loss_fn, opt, batches[0], policy)
    got = [step(b).item() for b in batches]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    want = []
    for x, y in batches:
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, rel=1e-3), (got, want)

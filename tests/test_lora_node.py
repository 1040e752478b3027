"""The lora_linear op's common call as a C++ autograd node (``_infra/_lora_node.cpp``),
against the op's Python path (``_LoraJoined``), on peft models built from transformers'
configs. On a GPU the node runs every such call; here the tests let it run on the CPU.
The node calls the same ATen ops in the same order, so losses and gradients are equal to
the bit."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("triton")

from tiny_configs import SMALL  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops import lora_linear  # noqa: E402
from xpuruntime.pytorch._ops._infra import _native  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("our kernels run on the CPU under TRITON_INTERPRET=1", allow_module_level=True)

_GEMMA3 = {"layer_types": ["sliding_attention", "full_attention"]}


@pytest.fixture(scope="module")
def node():
    """The C++ node's module, built here if no earlier run has (about 30 s)."""
    module = _native.lora_node()
    if module is None:
        pytest.skip(f"the C++ node could not be built: {_native.lora_node_unavailable()}")
    return module


def _model(model_type: str, base_dtype: torch.dtype, adapter_dtype: torch.dtype):
    """A tiny peft model, LoRA on all linear layers, its base and adapters in those
    dtypes, optimized."""
    from peft import LoraConfig, get_peft_model

    extra = _GEMMA3 if model_type == "gemma3_text" else {}
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.to(base_dtype)
    with torch.no_grad():  # adapters as trained ones are: B no longer zero
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(adapter_dtype)
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    xpt.optimize(model)
    return model


def _run(model, autocast: bool):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, _native_nodes(loss)


def _native_nodes(loss) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += node.name() == "LoraJoinedBackward"
        stack += [next_node for next_node, _ in node.next_functions]
    return count


@pytest.mark.parametrize(
    ("base", "adapters", "autocast"),
    [
        (torch.bfloat16, torch.bfloat16, False),  # the base joined again in the backward
        (torch.bfloat16, torch.float32, True),  # peft's own: fp32 adapters, their grads too
        (torch.float32, torch.float32, True),  # the base's bf16 cast kept for the backward
    ],
    ids=["bf16", "bf16-base-fp32-adapters-autocast", "fp32-autocast"],
)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_the_node_trains_as_the_python_path_to_the_bit(
    node, model_type, base, adapters, autocast, monkeypatch
):
    model = _model(model_type, base, adapters)
    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", ())
    python_loss, python_grads, none = _run(model, autocast)
    assert none == 0
    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,))
    loss, grads, nodes = _run(model, autocast)
    assert nodes == 4 * SMALL["num_hidden_layers"]  # q/k/v, o, gate/up, down: every group
    assert torch.equal(loss, python_loss)
    assert grads.keys() == python_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == python_grads[name].dtype, name
        assert torch.equal(grad, python_grads[name]), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_model_recomputes_through_the_node_as_through_the_python_path(
    node, reentrant, monkeypatch
):
    """Under gradient checkpointing the node's saved tensors go through the checkpoint's
    hooks, and the forward run again inside the backward records its own graph."""
    model = _model("llama", torch.bfloat16, torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()  # (reentrant: an input that needs a gradient)
    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", ())
    python_loss, python_grads, _ = _run(model, False)
    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,))
    calls = []

    def counted(*args):
        calls.append(torch.is_grad_enabled())
        return node.lora_forward(*args)

    monkeypatch.setattr(lora_linear, "_native_node", lambda: SimpleNamespace(lora_forward=counted))
    loss, grads, _ = _run(model, False)
    # Each group once a forward; reentrant: the forward runs without autograd (the op's
    # Python path), and only the one run again in the backward records through the node.
    assert len(calls) == (1 if reentrant else 2) * 4 * SMALL["num_hidden_layers"]
    assert torch.equal(loss, python_loss)
    assert all(torch.equal(grads[name], python_grads[name]) for name in python_grads)


@pytest.mark.parametrize("rank", [4, 80], ids=["product-given", "product-refused"])
def test_an_activations_output_is_read_through_its_maker_as_on_the_python_path(
    node, rank, monkeypatch
):
    """down_proj's input, a SwiGLU's output: dA comes from the activation's own product
    (rank 4), or where that kernel refuses (rank 80, over its 64) from its output made
    again; gradients equal the Python path's to the bit."""
    from xpuruntime.pytorch._ops import swiglu

    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(20, 32, generator=g).to(DEVICE, torch.bfloat16) for _ in "gu")
    w = torch.randn(8, 32, generator=g).to(DEVICE, torch.bfloat16)
    a = torch.randn(rank, 32, generator=g).to(DEVICE, torch.bfloat16)
    b = torch.randn(8, rank, generator=g).to(DEVICE, torch.bfloat16)
    grads = {}
    for devices in ((), (DEVICE,)):
        monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", devices)
        leaves = [t.detach().requires_grad_() for t in (gate, up, a, b)]
        h = swiglu.run_swiglu(*leaves[:2])
        out = lora_linear.lora_projections(h, (w,), (), (leaves[2],), (leaves[3],), (0.5,))[0]
        assert (out.grad_fn.name() == "LoraJoinedBackward") == bool(devices)
        out.square().sum().backward()
        grads[devices] = [t.grad for t in leaves]
    assert all(torch.equal(p, n) for p, n in zip(grads[()], grads[(DEVICE,)]))


def test_two_threads_training_at_once_each_get_the_gradients_of_one_alone(node, monkeypatch):
    """The node's backward takes the GIL to call back into Python; two threads stepping
    two models at once neither block each other nor mix their gradients."""
    import threading

    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,))
    models = [_model("qwen3", torch.bfloat16, torch.bfloat16) for _ in range(2)]
    _, want, _ = _run(models[0], False)
    got, errors = [None, None], []

    def train(i):
        try:
            for _ in range(3):
                got[i] = _run(models[i], False)[1]
        except Exception as e:  # (raised again in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    for grads in got:
        assert all(torch.equal(grads[name], want[name]) for name in want)


def test_calls_the_node_does_not_take_run_the_python_path(node, monkeypatch):
    """A trained base (its gradient), or dropout, is the Python path's."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,))
    config = transformers.AutoConfig.for_model("llama", **SMALL)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
    model = get_peft_model(base, lora).to(torch.bfloat16)
    xpt.optimize(model)
    _, _, nodes = _run(model, False)
    assert nodes == 0
    model.eval()  # (dropout off): now the node's
    _, _, nodes = _run(model, False)
    assert nodes == 4 * SMALL["num_hidden_layers"]
    for name, p in model.named_parameters():
        if "q_proj.base_layer" in name:
            p.requires_grad_(True)
    _, grads, nodes = _run(model, False)
    assert nodes == 4 * SMALL["num_hidden_layers"] - SMALL["num_hidden_layers"]
    assert any("q_proj.base_layer" in name for name in grads)


def test_an_error_in_the_backward_is_raised_to_the_caller_and_the_next_step_runs(node, monkeypatch):
    """A failure in what the node calls back (making the input again) reaches the
    caller's backward with its text, and poisons nothing: the next step trains."""
    from xpuruntime.pytorch._ops._infra import _recompute

    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,))
    model = _model("llama", torch.bfloat16, torch.bfloat16)
    _, want, _ = _run(model, False)
    real = _recompute.recomputable

    def broken(tensor):
        found = real(tensor)
        if found is None:
            return None

        def fails(*inputs):
            raise RuntimeError("made again: broken on purpose")

        return found._replace(function=fails, product=None)

    monkeypatch.setattr(lora_linear, "recomputable", broken)
    with pytest.raises(RuntimeError, match="made again: broken on purpose"):
        _run(model, False)
    monkeypatch.setattr(lora_linear, "recomputable", real)
    _, grads, _ = _run(model, False)
    assert all(torch.equal(grads[name], want[name]) for name in want)

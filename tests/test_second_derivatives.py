"""Our ops' backwards are kernels, so they give first derivatives only. A backward
autograd is asked to record (``create_graph=True``: a gradient penalty, a Hessian-vector
product) is refused with an error naming the op, not run into gradients whose own graph
is silently wrong; nothing is poisoned for the next step, and the model as written
(``revert()``) is differentiated twice as before."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("triton")

from tiny_configs import SMALL  # noqa: E402

from xpuruntime import UnsupportedOperationError  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops import lora_linear  # noqa: E402
from xpuruntime.pytorch._ops._infra import _native  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("our kernels run on the CPU under TRITON_INTERPRET=1", allow_module_level=True)


def _model(lora: bool):
    """A tiny Llama (attention as written: SDPA's CPU kernel has no second derivative),
    with LoRA on all linear layers or trained whole, and an untouched copy."""
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.for_model("llama", **SMALL)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # adapters as trained ones are: B no longer zero
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(generator=torch.Generator(DEVICE).manual_seed(len(name)))
    return model, copy.deepcopy(model)


_IDS = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))


def _penalty(model):
    """The squared norm of the loss's gradient by the input embeddings, and its gradient
    by every trained parameter (a second derivative)."""
    ids = _IDS.to(DEVICE)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    loss = model(inputs_embeds=embeds, labels=ids).loss
    (grad,) = torch.autograd.grad(loss, embeds, create_graph=True)
    trained = [p for p in model.parameters() if p.requires_grad]  # (the embeddings: unused)
    return torch.autograd.grad(grad.square().sum(), trained, allow_unused=True)


def _gradients(model):
    model.zero_grad(set_to_none=True)
    ids = _IDS.to(DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("lora", [True, False], ids=["peft-lora", "full"])
def test_a_gradient_penalty_is_refused_and_the_next_step_trains_as_the_model_as_written(lora):
    model, written = _model(lora)
    report = xpt.optimize(model)
    with pytest.raises(UnsupportedOperationError, match="first derivatives only.*create_graph"):
        _penalty(model)
    for got, want in zip(_gradients(model), _gradients(written), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    report.revert()  # the model as written: differentiated twice, as the untouched copy
    for got, want in zip(_penalty(model), _penalty(written), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _lora_call(native: bool, monkeypatch, create_graph: bool):
    monkeypatch.setattr(lora_linear, "_NATIVE_DEVICES", (DEVICE,) if native else ())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(DEVICE).requires_grad_()
    weights = (
        torch.randn(16, 16, generator=g).to(DEVICE),
        torch.randn(8, 16, generator=g).to(DEVICE),
    )
    lora_as = tuple(torch.randn(4, 16, generator=g).to(DEVICE).requires_grad_() for _ in weights)
    lora_bs = tuple(
        torch.randn(w.shape[0], 4, generator=g).to(DEVICE).requires_grad_() for w in weights
    )
    outs = lora_linear.lora_projections(x, weights, (), lora_as, lora_bs, (2.0, 2.0))
    loss = sum(out.square().sum() for out in outs)
    names, stack = set(), [loss.grad_fn]
    while stack:  # (the nodes the loss's backward runs)
        node = stack.pop()
        if node is not None:
            names.add(node.name())
            stack += [next_node for next_node, _ in node.next_functions]
    return torch.autograd.grad(loss, (x, *lora_as, *lora_bs), create_graph=create_graph), names


@pytest.mark.parametrize("native", [False, True], ids=["python-path", "cpp-node"])
def test_the_lora_ops_backward_refuses_create_graph_on_either_path_and_then_runs(
    native, monkeypatch
):
    """The C++ node raises the same error as the Python path (its type kept through the
    engine), and its next backward runs."""
    if native and _native.lora_node() is None:
        pytest.skip(f"the C++ node could not be built: {_native.lora_node_unavailable()}")
    with pytest.raises(
        UnsupportedOperationError,
        match="lora_linear's backward .* first derivatives only.*revert\\(\\)",
    ):
        _lora_call(native, monkeypatch, create_graph=True)
    grads, names = _lora_call(native, monkeypatch, create_graph=False)
    assert ("LoraJoinedBackward" in names) == native  # (the C++ node's name)
    python_grads, _ = _lora_call(False, monkeypatch, create_graph=False)
    for got, want in zip(grads, python_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("logged", [False, True], ids=["autograd-function", "registered-op"])
def test_a_norm_called_alone_refuses_alike_on_either_call_path(logged):
    """An op called from ``xpt.ops`` refuses as well, through its autograd Function or,
    while the dispatch log records, through its registered torch op; its next backward
    runs."""
    from xpuruntime.kernels import dispatcher

    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(32, device=DEVICE, requires_grad=True)
    (dispatcher.log.enable if logged else dispatcher.log.disable)()
    try:
        out = xpt.ops.fused_rmsnorm(x, (32,), weight)
        with pytest.raises(UnsupportedOperationError, match="xpuruntime::rms_norm's backward"):
            torch.autograd.grad(out.square().sum(), x, create_graph=True)
        (grad,) = torch.autograd.grad(xpt.ops.fused_rmsnorm(x, (32,), weight).sum(), x)
    finally:
        dispatcher.log.disable()
    assert grad.shape == x.shape

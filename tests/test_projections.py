"""The policy's projections op: linear layers of one input as one GEMM, the same numbers
and gradients as each layer run as written; layers it cannot join (a subclass, a hook,
mixed biases, other widths) run as written; forwards that call children on one input
are rewritten to call them together, and only where that changes nothing."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from kept_for_backward import kept_for_backward  # noqa: E402
from torch import nn  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._functional._projections import joined_halves, projections  # noqa: E402
from xpuruntime.pytorch._optimize._statements import rewritten_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layers(bias: bool, sizes=(24, 8, 8), width=16, dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Linear(width, n, bias=bias).to(dtype) for n in sizes]


def _by_kernel(layers, x, autocast=None):
    """kernel -> (outputs, [x's gradient, every parameter's]) for each projections kernel,
    from a weighted sum of the outputs (optionally under autocast to ``autocast``)."""
    results = {}
    for kernel in ("fused", "torch"):
        xpt.set_kernel_policy({"kernels": {"projections": kernel}, "strict": True})
        for layer in layers:
            layer.zero_grad()
        xi = x.detach().clone().requires_grad_()
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            outs = projections(xi, *layers)
        sum((o.float() * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        grads = [xi.grad, *(p.grad for layer in layers for p in layer.parameters())]
        results[kernel] = (outs, grads)
    return results


@pytest.mark.parametrize("bias", [True, False])
def test_joined_layers_give_each_layers_output_and_every_gradient(bias):
    layers = _layers(bias)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    results = _by_kernel(layers, x.float())
    # float64 reference
    want = [
        x @ layer.weight.double().t() + (layer.bias.double() if bias else 0) for layer in layers
    ]
    for got, ref in zip(results["fused"][0], want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    for got, ref in zip(results["fused"][1], results["torch"][1]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_under_autocast_the_gradients_come_back_in_each_parameters_dtype(bias):
    """bf16 autocast over fp32 layers (on the GPU too, where the weight gradient's GEMM
    writes fp32 itself): the layers' own outputs and gradients, within bf16's rounding."""
    layers = [layer.to(DEVICE) for layer in _layers(bias)]
    x = torch.randn(3, 7, 16, device=DEVICE)
    results = _by_kernel(layers, x, autocast=torch.bfloat16)
    assert all(o.dtype == torch.bfloat16 for outs, _ in results.values() for o in outs)
    assert all(g.dtype == torch.float32 for g in results["fused"][1])
    for got, want in zip((*results["fused"][0], *results["fused"][1]),
                         (*results["torch"][0], *results["torch"][1])):  # fmt: skip
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_keeps_no_more_than_the_layers_as_written(dtype):
    """fp32 parameters under bf16 autocast: the joined cast is kept, as each layer keeps
    its cast weight; bf16 parameters (FSDP2's mixed precision, a bf16 model): nothing
    but the input, the weights joined again in the backward, with the same gradients."""
    layers = [layer.to(DEVICE) for layer in _layers(False, dtype=dtype)]
    parameters = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(3, 7, 16, device=DEVICE, requires_grad=True)
    kept = {}
    for kernel in ("fused", "torch"):
        xpt.set_kernel_policy({"kernels": {"projections": kernel}, "strict": True})

        def run():
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return projections(x, *layers)

        kept[kernel] = kept_for_backward(run, parameters)
    assert kept["fused"] <= kept["torch"]
    if dtype == torch.bfloat16:
        assert kept["fused"] == x.numel() * 2  # the bf16 input alone
    results = _by_kernel(layers, x.detach(), autocast=torch.bfloat16)
    for got, want in zip(results["fused"][1], results["torch"][1]):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_two_layers_of_one_width_come_back_as_halves_of_one_output():
    layers = _layers(False, sizes=(8, 8))
    xpt.set_kernel_policy({"kernels": {"projections": "fused"}, "strict": True})
    g, u = projections(torch.randn(4, 16), *layers)
    packed = joined_halves(g, u)
    assert packed is not None and packed.shape == (4, 16)
    assert torch.equal(packed[:, :8], g) and torch.equal(packed[:, 8:], u)
    assert joined_halves(u, g) is None  # the halves the other way round
    xpt.set_kernel_policy({"kernels": {"projections": "torch"}, "strict": True})
    assert joined_halves(*projections(torch.randn(4, 16), *layers)) is None


class _Scaled(nn.Linear):
    def forward(self, input):
        return 2 * super().forward(input)


@pytest.mark.parametrize(
    "change",
    ["subclass", "forward hook", "pre hook", "mixed bias", "other width", "other dtype",
     "input dtype"],
)  # fmt: skip
def test_layers_that_cannot_be_joined_run_as_written(change):
    layers = _layers(True)
    called = []
    if change == "subclass":
        layers[1] = _Scaled(16, 8)
    elif change == "forward hook":
        layers[2].register_forward_hook(lambda m, i, o: called.append(m))
    elif change == "pre hook":
        layers[0].register_forward_pre_hook(lambda m, i: called.append(m))
    elif change == "mixed bias":
        layers[1] = nn.Linear(16, 8, bias=False)
    elif change == "other width":
        layers[1] = nn.Linear(12, 8)
    else:
        layers[1] = nn.Linear(16, 8).double()
    xpt.set_kernel_policy({"kernels": {"projections": "fused"}, "strict": True})
    x = torch.randn(3, 16)
    if change == "other width":
        with pytest.raises(RuntimeError):  # the layer's own error, as written
            projections(x, *layers)
        return
    if change in ("other dtype", "input dtype"):
        if change == "input dtype":  # F.linear refuses a bf16 input to fp32 layers
            x = x.bfloat16()
        with pytest.raises(RuntimeError):
            projections(x, *layers)
        return
    xpt.enable_dispatch_logging()
    outs = projections(x, *layers)
    xpt.disable_dispatch_logging()
    assert not [r for r in xpt.get_dispatch_logs() if r.op == "projections"]
    xpt.clear_dispatch_logs()
    for got, layer in zip(outs, layers):
        assert torch.equal(got, layer(x))
    assert bool(called) == change.endswith("hook")  # the hook ran


# -- the rewrite --------------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 8)
        self.v = nn.Linear(16, 8)

    def forward(self, h):
        shape = (*h.shape[:-1], -1, 4)
        q = self.q(h).view(shape).transpose(1, 2)
        k = self.k(h).view(shape)
        v = torch.relu(self.v(h))
        return q.sum() + k.sum() + v.sum()


class _ReadsBetween(_Attention):
    def forward(self, h):
        q = self.q(h)
        k = self.k(h) + h[..., :8]  # h read again in the run: not joined
        return q.sum() + k.sum()


class _AssignsBetween(_Attention):
    def forward(self, h):
        q = self.q(h)
        h = h * 2
        k = self.k(h)
        v = self.v(h)
        return q.sum() + k.sum() + v.sum()


def test_a_forward_calling_children_on_one_input_calls_them_together():
    module = _Attention()
    calls = []

    def helper(x, *layers):
        calls.append(tuple(layers))
        return projections(x, *layers)

    forward, found = rewritten_forward(module, {"projections": helper})
    assert found == {"projections": [("q", "k", "v")]}
    h = torch.randn(2, 3, 16)
    assert torch.allclose(types.MethodType(forward, module)(h), module(h), atol=1e-5)
    assert calls == [(module.q, module.k, module.v)]


def test_statements_that_read_or_assign_the_input_between_calls_are_left_as_written():
    assert rewritten_forward(_ReadsBetween(), {"projections": projections}) is None
    forward, found = rewritten_forward(_AssignsBetween(), {"projections": projections})
    assert found == {"projections": [("k", "v")]}  # after the assignment only
    module, h = _AssignsBetween(), torch.randn(2, 16)
    assert torch.allclose(types.MethodType(forward, module)(h), module(h), atol=1e-5)


def test_optimize_joins_the_projections_reports_them_and_reverts():
    module = nn.Sequential(_Attention())
    h = torch.randn(2, 3, 16)
    want = module(h)
    report = xpt.optimize(module, {"kernels": {"projections": "fused"}})
    assert report.joined_projections == ["0: q, k, v"]
    assert torch.allclose(module(h), want, atol=1e-5)
    report.revert()
    assert "forward" not in module[0].__dict__
    for kernels in ({"projections": "torch"}, {"linear": "fused"}):  # as written / the linear op's
        report = xpt.optimize(module, {"kernels": kernels})
        assert report.joined_projections == []
        report.revert()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_attention_keeps_v_alone_not_the_joined_output_it_is_a_view_of(monkeypatch, lora):
    """A transformers Llama's q, k and v run as one GEMM; attention keeps v for its
    backward, and q and k are rotated into new tensors. So v is copied out of the joined
    output, which is then freed: nothing the backward keeps lies in it. Where attention
    keeps v as given (PyTorch's CPU kernel, flash on CUDA), each layer keeps q's and k's
    columns less than with v a view."""
    transformers = pytest.importorskip("transformers")
    from tiny_configs import SMALL

    from xpuruntime.pytorch._functional import _projections

    config = transformers.AutoConfig.for_model("llama", **SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    model = model.to(DEVICE).train()
    report = xpt.optimize(model)
    assert len(report.joined_projections) == 4  # (each layer's q/k/v and gate/up)
    ids = torch.randint(3, 96, (2, 16), device=DEVICE)
    parameters = list(model.parameters())
    joined, held = set(), []  # the q/k/v groups' joined outputs (held: no address reused)
    value_apart = _projections._value_apart

    def noted(outputs):
        if len(outputs) == 3:
            held.append(outputs[0])
            joined.add(outputs[0].untyped_storage().data_ptr())
        return value_apart(outputs)

    def run():
        return model(input_ids=ids, labels=ids).loss

    kept_in = set()

    def pack(t):
        kept_in.add(t.untyped_storage().data_ptr())
        return t

    monkeypatch.setattr(_projections, "_value_apart", noted)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    assert len(joined) == SMALL["num_hidden_layers"] and not joined & kept_in
    loss.backward()
    if DEVICE == "cpu":
        kept = kept_for_backward(run, parameters)
        monkeypatch.setattr(_projections, "_value_apart", lambda outputs: outputs)
        kept_as_views = kept_for_backward(run, parameters)
        q_and_k = SMALL["head_dim"] * (SMALL["num_attention_heads"] + SMALL["num_key_value_heads"])
        assert kept_as_views - kept == SMALL["num_hidden_layers"] * ids.numel() * q_and_k * 4


def test_v_as_wide_as_q_stays_a_view_as_bert_like_attention_may_keep_q_and_k_too():
    x = torch.randn(2, 5, 16, requires_grad=True)
    xpt.set_kernel_policy({"kernels": {"projections": "fused"}, "strict": True})
    _, _, narrow = projections(x, *_layers(False, sizes=(24, 8, 8)))
    _, _, wide = projections(x, *_layers(False, sizes=(8, 8, 8)))
    assert narrow._base is None and narrow.is_contiguous()  # copied out (grouped-query)
    assert wide._base is not None  # a view of the joined output, as before

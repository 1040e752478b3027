"""The whole-training-step pieces that run anywhere: fused_linear_cross_entropy against a
float64 reference (CPU under TRITON_INTERPRET=1, compiled on a GPU), the LM head that
optimize() installs, the cross_entropy policy op, and the clear refusals of graphs and
allocator settings without CUDA."""

import copy
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch.ops import fused_linear_cross_entropy  # noqa: E402
from xpuruntime.pytorch.ops import fused_linear_cross_entropy as flce_module  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")

# (dtype, loss atol, grad atol) against float64; low precision carries the rounding of
# the logits and of the gradient GEMMs' inputs.
DTYPES = [(torch.float32, 1e-4, 1e-5), (torch.bfloat16, 3e-2, 3e-2), (torch.float16, 1e-2, 5e-3)]
# (rows, hidden, vocab): a single row, primes, a vocabulary past one block (4096).
SHAPES = [(1, 8, 5), (37, 16, 101), (64, 24, 4099), (13, 32, 1031)]


def _chunked(monkeypatch, rows_per_chunk):
    module = __import__(
        "xpuruntime.pytorch._ops.fused_linear_cross_entropy", fromlist=["chunk_rows"]
    )
    monkeypatch.setattr(module, "chunk_rows", lambda *shape: rows_per_chunk)


def _reference(x, w, b, t, reduction, ignore_index=-100):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    loss = F.cross_entropy(
        F.linear(x64, w64, b64), t, reduction=reduction, ignore_index=ignore_index
    )
    return loss, x64, w64, b64


@pytest.mark.parametrize("dtype, atol, gatol", DTYPES)
@pytest.mark.parametrize("rows, hidden, vocab", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy_matches_float64_forward_and_backward(
    monkeypatch, dtype, atol, gatol, rows, hidden, vocab, reduction
):
    _chunked(monkeypatch, 7)  # several chunks, the last one short
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=DEVICE).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=DEVICE)
    t[1::5] = -100  # ignored rows
    grad = torch.tensor(1.7, device=DEVICE)
    loss = fused_linear_cross_entropy(x, w, t, b, reduction=reduction)
    loss.backward(grad)
    ref, x64, w64, b64 = _reference(x, w, b, t, reduction)
    ref.backward(grad.double())
    scale = 1.0 if reduction == "mean" else rows
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, atol=atol * scale, rtol=1e-3)
    for got, want, name in ((x.grad, x64.grad, "input"), (w.grad, w64.grad, "weight"),
                            (b.grad, b64.grad, "bias")):  # fmt: skip
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, atol=gatol * scale, rtol=2e-2, msg=name)


@pytest.mark.parametrize("dtype, atol, gatol", DTYPES[:2])
@pytest.mark.parametrize(
    "scale, softcap",
    [(0.125, None), (4.0, None), (1.0, 3.0), (2.5, 0.75), (1.0, 1e-3), (-1.5, None)],
)
def test_fused_linear_cross_entropy_applies_a_scale_and_a_softcap_as_float64_does(
    monkeypatch, dtype, atol, gatol, scale, softcap
):
    """Granite's / Cohere's scale and Gemma 2's soft cap, inside the kernel (a cap far
    below the logits saturates tanh: the gradient's 1 - tanh^2 goes to 0, no NaN)."""
    rows, hidden, vocab = 29, 16, 4099
    _chunked(monkeypatch, 11)
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, device=DEVICE).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=DEVICE)
    t[3::7] = -100
    loss = fused_linear_cross_entropy(x, w, t, scale=scale, softcap=softcap)
    loss.backward()
    x64, w64 = (a.detach().double().requires_grad_() for a in (x, w))
    z = F.linear(x64, w64) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, t)
    ref.backward()
    bound = max(abs(scale), 1.0)  # the logits' rounding, scaled
    torch.testing.assert_close(loss.double(), ref, atol=atol * bound, rtol=1e-3)
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=gatol * bound, rtol=2e-2)


@pytest.mark.parametrize(
    "kwargs, words",
    [({"scale": 0.0}, "scale must be a finite, non-zero"),
     ({"scale": float("nan")}, "scale must be"),
     ({"scale": "2"}, "scale must be"),
     ({"softcap": 0.0}, "softcap must be a positive, finite"),
     ({"softcap": -3.0}, "softcap must be"),
     ({"softcap": float("inf")}, "softcap must be")],
)  # fmt: skip
def test_fused_linear_cross_entropy_refuses_a_transform_it_cannot_apply(kwargs, words):
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(11, 8, device=DEVICE)
    t = torch.randint(0, 11, (4,), device=DEVICE)
    with pytest.raises(xrt.InvalidInputError, match=words):
        fused_linear_cross_entropy(x, w, t, **kwargs)


def test_a_second_backward_through_the_fused_loss_is_refused_and_the_first_counted_once():
    x = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 11, (6,), device=DEVICE)
    loss = fused_linear_cross_entropy(x, w, t) * 3.0
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    with pytest.raises(xrt.UnsupportedOperationError, match="second backward"):
        loss.backward()
    assert torch.equal(w.grad, first)  # nothing added by the refused one
    ref, _, w64, _ = _reference(x, w, None, t, "mean")
    (ref * 3.0).backward()
    torch.testing.assert_close(first.double(), w64.grad, atol=1e-5, rtol=1e-4)
    fused_linear_cross_entropy(x, w, t).backward()  # a new loss trains as before


def test_fused_linear_cross_entropy_runs_the_projection_in_the_autocast_dtype():
    x = torch.randn(2, 9, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(50, 16, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 50, (2, 9), device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, t)
        ref = F.cross_entropy(F.linear(x, w).view(-1, 50), t.view(-1))
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref.float(), atol=2e-2, rtol=1e-2)
    ref_grad = torch.autograd.grad(ref, x)[0]
    torch.testing.assert_close(x.grad, ref_grad, atol=2e-2, rtol=5e-2)


def test_fused_linear_cross_entropy_without_grad_only_computes_the_loss():
    x, w = torch.randn(11, 8, device=DEVICE), torch.randn(29, 8, device=DEVICE)
    t = torch.randint(0, 29, (11,), device=DEVICE)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, t)
    torch.testing.assert_close(loss, F.cross_entropy(x @ w.T, t), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"reduction": "none"}, xrt.UnsupportedOperationError, "reduction 'none'"),
        ({"w_shape": (29, 9)}, xrt.InvalidInputError, "agree on H"),
        ({"t_shape": (10,)}, xrt.InvalidInputError, "leading shape"),
        ({"t_float": True}, xrt.InvalidInputError, "integer class indices"),
        ({"b_shape": (28,)}, xrt.InvalidInputError, "bias must have shape (29,)"),
    ],
)
def test_fused_linear_cross_entropy_refuses_bad_input_by_name(kwargs, error, words):
    x = torch.randn(11, 8, device=DEVICE)
    w = torch.randn(*kwargs.get("w_shape", (29, 8)), device=DEVICE)
    t = torch.randint(0, 29, kwargs.get("t_shape", (11,)), device=DEVICE)
    if kwargs.get("t_float"):
        t = t.float()
    b = torch.randn(*kwargs["b_shape"], device=DEVICE) if "b_shape" in kwargs else None
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        fused_linear_cross_entropy(x, w, t, b, reduction=kwargs.get("reduction", "mean"))


# -- the LM head optimize() installs -----------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab=61, d=16, tied=True, name="lm_head"):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        head = nn.Linear(d, vocab, bias=False)
        if tied:
            head.weight = self.wte.weight
        self.head_name = name
        setattr(self, name, head)

    def forward(self, idx):
        return getattr(self, self.head_name)(self.norm(self.wte(idx)))


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _pair(**kwargs):
    torch.manual_seed(0)
    model = TinyLM(**kwargs).to(DEVICE)
    reference = TinyLM(**kwargs).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _same_as_the_reference(loss, model, reference, idx, targets, transform=lambda z: z):
    """``loss`` (backpropagated) and ``model``'s gradients equal the untouched
    ``reference``'s on the same batch."""
    ref = _lm_loss(transform(reference(idx)), targets)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("tied, name", [(True, "lm_head"), (True, "out"), (False, "lm_head")])
def test_optimize_fuses_the_lm_head_into_the_loss_with_the_same_loss_and_gradients(tied, name):
    model, reference = _pair(tied=tied, name=name)
    report = xpt.optimize(model, {"kernels": {"cross_entropy": "fused_linear"}})
    assert any(new == "LinearCrossEntropyHead" for _, _, new in report.replaced), str(report)
    idx = torch.randint(0, 61, (3, 10), device=DEVICE)
    targets = torch.randint(0, 61, (3, 10), device=DEVICE)
    logits = model(idx)
    assert isinstance(logits, xpt.DeferredLogits) and logits.shape == (3, 10, 61)
    loss = _lm_loss(logits, targets)
    loss.backward()
    _same_as_the_reference(loss, model, reference, idx, targets)
    report.revert()
    assert type(getattr(model, name)) is nn.Linear
    assert not isinstance(model(idx), xpt.DeferredLogits)


def test_other_uses_of_deferred_logits_materialise_them_and_warn():
    model, reference = _pair()
    xpt.optimize(model, {"kernels": {"cross_entropy": "fused_linear"}})
    idx = torch.randint(0, 61, (2, 5), device=DEVICE)
    with pytest.warns(UserWarning, match="materialised"):
        probs = model(idx).softmax(-1)
    torch.testing.assert_close(probs, reference(idx).softmax(-1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        argmax = model(idx).argmax(-1)
    assert torch.equal(argmax, reference(idx).argmax(-1))


_SINK_RAN: list = []


class _OutputSink(torch.autograd.Function):
    """What DistributedDataParallel puts on a model's outputs on a static graph's first
    step (and under find_unused_parameters): a clone, and a backward that must run."""

    @staticmethod
    def forward(ctx, logits):
        ctx.set_materialize_grads(False)
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        _SINK_RAN.append(grad)
        return grad


@pytest.mark.parametrize("fused", [True, False])
def test_a_function_that_clones_the_logits_keeps_them_deferred_and_runs_its_backward(fused):
    model, reference = _pair()
    xpt.optimize(
        model, {"kernels": {"cross_entropy": "fused_linear" if fused else "torch_chunked"}}
    )
    idx = torch.randint(0, 61, (3, 10), device=DEVICE)
    targets = torch.randint(0, 61, (3, 10), device=DEVICE)
    _SINK_RAN.clear()
    logits = model(idx)
    assert logits.grad_fn is not None  # a walk from the outputs finds the parameters
    hooked = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing materialised
        assert logits._base is None  # as FSDP2 asks of a module's outputs
        logits.register_hook(hooked.append)  # as FSDP2 hooks them: called, with None
        held = _OutputSink.apply(logits)
        assert isinstance(held, xpt.DeferredLogits) and held.requires_grad
        loss = _lm_loss(held.float(), targets)
    loss.backward()
    assert len(_SINK_RAN) == 1  # the sink's backward ran (no gradient through it)
    assert hooked == [None]
    _same_as_the_reference(loss, model, reference, idx, targets)
    # materialised logits run it too
    _SINK_RAN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _OutputSink.apply(model(idx)).softmax(-1).sum().backward()
    assert len(_SINK_RAN) == 1


_TRANSFORMS = {
    # as the models write them: Granite, Cohere, Gemma 2 (its soft cap), and one the fused
    # loss cannot take (two tanh), for which the policy falls back to PyTorch's loss, said
    "divided": (lambda z: z / 8.0, None),
    "scaled": (lambda z: 0.0625 * z, None),
    "softcapped": (lambda z: torch.tanh(z / 30.0) * 30.0, None),
    "cast then capped": (lambda z: torch.mul(torch.tanh(z.float().div(2.0)), 2), None),
    "two tanh": (lambda z: torch.tanh(torch.tanh(z)), "transformed otherwise than a scale"),
}


@pytest.mark.parametrize("name", sorted(_TRANSFORMS))
def test_logits_transformed_before_the_loss_stay_deferred_and_read_as_the_models(name):
    transform, refused = _TRANSFORMS[name]
    model, reference = _pair()
    xpt.optimize(model, {"kernels": {"cross_entropy": "fused_linear"}})
    idx = torch.randint(0, 61, (3, 10), device=DEVICE)
    targets = torch.randint(0, 61, (3, 10), device=DEVICE)
    logits = transform(model(idx))
    assert isinstance(logits, xpt.DeferredLogits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _lm_loss(logits, targets)
    said = [str(w.message) for w in caught]
    assert any(refused in m for m in said) if refused else said == []
    loss.backward()
    _same_as_the_reference(loss, model, reference, idx, targets, transform)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # read afterwards: the same ops in the same dtypes as on the head's logits
        head = model(idx)
        assert torch.equal(transform(head).softmax(-1), transform(head.materialize()).softmax(-1))


class _LossInForward(nn.Module):
    """A model computing its loss in its forward after its head, as transformers' do."""

    def __init__(self, vocab=61, d=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        hidden = torch.tanh(self.wte(idx))
        logits = self.lm_head(hidden)
        loss = None if targets is None else _lm_loss(logits.float(), targets)
        return loss, logits


class _OnePathVariable(_LossInForward):
    """The same, reading after its head a variable that one path alone set."""

    def forward(self, idx, targets=None, scaled=True):
        hidden = torch.tanh(self.wte(idx))
        if scaled:
            scale = 0.5
        logits = self.lm_head(hidden)
        logits = logits * scale if scaled else logits
        loss = None if targets is None else _lm_loss(logits.float(), targets)
        return loss, logits


@pytest.mark.parametrize("branchy", [False, True], ids=["split", "one-path-variable"])
def test_under_compile_the_head_and_loss_run_outside_the_graph_where_the_forward_splits(
    branchy,
):
    """A forward whose statements from the head's call on read only what it set on every
    path is split there: the compiled graph ends at the hidden states, the logits stay
    deferred and the loss is the fused one. Where they read a variable set on one path
    only, the forward is traced whole and the report says so; the loss and gradients are
    the model's either way. Without gradients the forward traces whole (the logits are
    read anyway)."""
    torch.manual_seed(0)
    kind = _OnePathVariable if branchy else _LossInForward
    model, reference = kind(), kind()
    reference.load_state_dict(model.state_dict())
    report = xpt.optimize(model, {"kernels": {"cross_entropy": "fused_linear"}})
    widths = []

    def backend(graph, inputs):
        widths.extend(
            v.shape[-1] for n in graph.graph.nodes
            if isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.dim()
        )  # fmt: skip
        return graph.forward

    idx = torch.randint(0, 61, (3, 10), device=DEVICE)
    targets = torch.randint(0, 61, (3, 10), device=DEVICE)
    compiled = torch.compile(model, backend=backend)
    loss, logits = compiled(idx, targets)
    ref_loss, _ = reference(idx, targets)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    if branchy:
        assert report.heads_outside_the_graph == []
        assert any(path == "<model>" and "not split at lm_head" in why
                   for path, why in report.skipped), report.skipped  # fmt: skip
        assert 61 in widths  # the graph computed the logits
    else:
        assert report.heads_outside_the_graph == ["<model>"]
        assert isinstance(logits, xpt.DeferredLogits)
        assert widths and 61 not in widths  # the graph ends at the hidden states
        with torch.no_grad():  # generate's case: every logit is read, nothing to defer
            _, logits = compiled(idx)
            assert type(logits) is torch.Tensor and 61 in widths
            torch.testing.assert_close(logits, reference(idx)[1], atol=1e-5, rtol=1e-5)


def test_cross_entropy_torch_in_the_policy_leaves_the_head_alone():
    model, _ = _pair()
    report = xpt.optimize(model, {"kernels": {"cross_entropy": "torch"}})
    assert ("lm_head", "the policy's cross_entropy is 'torch'") in report.skipped
    assert type(model.lm_head) is nn.Linear


def test_strict_policy_refuses_a_loss_the_fused_kernel_cannot_take():
    model, _ = _pair()
    xpt.optimize(model, {"strict": True, "kernels": {"cross_entropy": "fused_linear"}})
    logits = model(torch.randint(0, 61, (2, 5), device=DEVICE)).view(-1, 61)
    targets = torch.randint(0, 61, (10,), device=DEVICE)
    with pytest.raises(xrt.UnsupportedOperationError, match="label smoothing"):
        F.cross_entropy(logits, targets, label_smoothing=0.1)


def test_non_strict_policy_falls_back_to_the_materialised_loss_with_a_warning():
    model, reference = _pair()
    xpt.optimize(model, {"kernels": {"cross_entropy": "fused_linear"}})
    idx = torch.randint(0, 61, (2, 5), device=DEVICE)
    targets = torch.randint(0, 61, (10,), device=DEVICE)
    with pytest.warns(UserWarning):
        loss = F.cross_entropy(model(idx).view(-1, 61), targets, reduction="none")
    ref = F.cross_entropy(reference(idx).view(-1, 61), targets, reduction="none")
    torch.testing.assert_close(loss, ref)


def test_kernel_policy_knows_the_cross_entropy_op():
    policy = xrt.KernelPolicy(cross_entropy="FUSED_LINEAR")
    assert policy.get("cross_entropy") == "fused_linear"
    with pytest.raises(xrt.PolicyError, match="fused_linear"):
        xrt.KernelPolicy(cross_entropy="liger")


# -- refusals without CUDA --------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="checks the refusals of a machine without CUDA")
def test_graphs_and_allocator_settings_say_they_need_cuda():
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sample = (torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
        xpt.make_graphed_train_step(model, F.mse_loss, opt, sample)
    with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
        xpt.CUDAGraphWrapper().capture(model, sample[0])
    with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
        xpt.capture_graph()
    for call in (lambda: xpt.set_allocator("expandable_segments"), xpt.allocator_stats,
                 lambda: xpt.memory_pool().__enter__()):  # fmt: skip
        with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
            call()


def test_set_allocator_names_the_valid_kinds_and_when_cuda_malloc_async_can_be_chosen():
    with pytest.raises(xrt.PolicyError, match="expandable_segments"):
        xpt.set_allocator("pinned")
    if torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        pytest.skip("this process already runs cudaMallocAsync")
    with pytest.raises(
        xrt.UnsupportedOperationError, match="PYTORCH_ALLOC_CONF=backend:cudaMallocAsync"
    ):
        xpt.set_allocator("cuda_malloc_async")


def test_graph_wrapper_checks_its_arguments():
    with pytest.raises(xrt.InvalidInputError, match="warmup_iters"):
        xpt.CUDAGraphWrapper(warmup_iters=-1)


def test_a_host_read_the_capture_checks_refuse_names_the_line_that_called_it():
    # Where the read sits in a library (transformers' look at packed positions), the
    # op's name alone does not say where to look.
    from xpuruntime.pytorch._graphs.capture import run_checked

    value = torch.tensor(2.0)  # 0-dim: the checks allow CPU scalars, not reading them

    def logged():
        return value.item()

    line = logged.__code__.co_firstlineno + 1
    with pytest.raises(xrt.UnsupportedOperationError) as refused:
        run_checked(logged)
    assert str(refused.value).startswith(
        f"aten._local_scalar_dense (called at {__file__}:{line}, in logged) reads a value"
    )
    assert run_checked(lambda: value * 2) == 4  # the refusal left nothing behind


# -- one policy for the whole step ------------------------------------------------------------
def test_the_checked_warm_up_run_leaves_compiled_code_to_compile_on_its_next_call():
    # Dynamo skips for good a frame it first meets under a TorchDispatchMode (the capture
    # checks are one), so the checked run must not be the compiled code's first call.
    from torch._dynamo.testing import CompileCounter

    from xpuruntime.pytorch._graphs.capture import run_checked as _run_checked

    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def scaled(x):
        return torch.sin(x) * 2

    x = torch.tensor(0.5)  # 0-dim: the checks allow CPU scalars
    torch.testing.assert_close(_run_checked(lambda: scaled(x)), torch.sin(x) * 2)
    assert counter.frame_count == 0
    scaled(x)
    assert counter.frame_count == 1


def test_kernel_policy_carries_precision_and_graph_capture_through_a_file(tmp_path):
    policy = xrt.KernelPolicy(precision="BF16", cuda_graph=True, cross_entropy="fused_linear")
    path = policy.save(tmp_path / "step.json")
    loaded = xrt.KernelPolicy.load(path)
    assert loaded == policy and loaded.precision == "bf16" and loaded.cuda_graph is True
    with pytest.raises(xrt.PolicyError, match="precision"):
        xrt.KernelPolicy(precision="int8")
    with pytest.raises(xrt.PolicyError, match="cuda_graph"):
        xrt.KernelPolicy(cuda_graph="yes")


def test_make_train_step_applies_the_policy_and_trains_like_the_plain_loop():
    model, reference = _pair()
    idx = torch.randint(0, 61, (4, 12), device=DEVICE)
    targets = torch.randint(0, 61, (4, 12), device=DEVICE)
    policy = {
        "precision": "fp32",
        "kernels": {"cross_entropy": "fused_linear", "layernorm": "fused"},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, report = xpt.make_train_step(model, _lm_loss, opt, (idx, targets), policy)
    assert isinstance(step, xpt.TrainStep) and len(report.replaced) == 2
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        loss = step((idx, targets))
        ref_opt.zero_grad()
        ref = _lm_loss(reference(idx), targets)
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    report.revert()


def test_an_eager_train_step_runs_its_backward_on_the_calling_thread():
    model, _ = _pair()
    seen = []
    model.lm_head.weight.register_hook(
        lambda g: seen.append((threading.get_ident(), torch._C._is_multithreading_enabled()))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 61, (4, 12), device=DEVICE)
    step, report = xpt.make_train_step(model, _lm_loss, opt, (idx, idx), {"precision": "fp32"})
    step((idx, idx))
    assert seen == [(threading.get_ident(), False)]
    assert torch._C._is_multithreading_enabled()  # as it was, after the step
    assert step.kernels_by_gpu_time is False  # nothing measured: no trial steps
    report.revert()


def test_make_train_step_in_fp16_scales_the_loss_and_trains():
    model, _ = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 61, (4, 12), device=DEVICE)
    targets = torch.randint(0, 61, (4, 12), device=DEVICE)
    step, report = xpt.make_train_step(model, _lm_loss, opt, (idx, targets), {"precision": "fp16"})
    losses = [float(step((idx, targets))) for _ in range(5)]
    assert step.grad_scaler is not None and step.grad_scaler.get_scale() > 1
    assert losses[-1] < losses[0]
    report.revert()


@pytest.mark.skipif(CUDA, reason="checks the refusal of a machine without CUDA")
def test_make_train_step_with_graph_capture_needs_cuda_and_reverts():
    model, _ = _pair()
    opt = torch.optim.AdamW(model.parameters())
    sample = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(xrt.UnsupportedOperationError, match="CUDA"):
        xpt.make_train_step(model, _lm_loss, opt, sample, {"cuda_graph": True})
    assert type(model.lm_head) is nn.Linear


def test_a_graphed_steps_saved_state_holds_what_a_step_writes_and_puts_it_back():
    """Before a graphed step's warm-up, the trained parameters, the buffers and the
    optimizer state are copied (to the host), and put back in place after capture; a
    frozen parameter outside the optimizer (a LoRA model's base) is not copied."""
    from xpuruntime.pytorch._training._train_step import _TrainingState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()

    step()  # optimizer state exists before the warm-up
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    saved = _TrainingState(model, optimizer)
    held = {id(t) for t, _ in saved._tensors}
    assert id(model[0].weight) in held and id(model[1].running_mean) in held
    assert id(model[0].bias) not in held
    step(), step()
    saved.restore()
    after = (model.state_dict(), optimizer.state_dict())
    for key, value in before[0].items():
        torch.testing.assert_close(after[0][key], value, rtol=0, atol=0, msg=key)
    for index, state in before[1]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(after[1]["state"][index][key], value, rtol=0, atol=0)


def test_a_target_out_of_range_makes_the_loss_nan_instead_of_reading_past_the_row():
    x, w = torch.randn(6, 8, device=DEVICE), torch.randn(29, 8, device=DEVICE)
    t = torch.randint(0, 29, (6,), device=DEVICE)
    t[2] = 29
    assert torch.isnan(fused_linear_cross_entropy(x, w, t))
    t[2] = -100  # ignore_index is not out of range
    assert torch.isfinite(fused_linear_cross_entropy(x, w, t))


def test_make_train_step_clips_the_gradient_norm_like_clip_grad_norm():
    model, reference = _pair()
    idx = torch.randint(0, 61, (4, 12), device=DEVICE)
    targets = torch.randint(0, 61, (4, 12), device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step, _ = xpt.make_train_step(model, _lm_loss, opt, (idx, targets), max_grad_norm=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        step((idx, targets))
        ref_opt.zero_grad()
        _lm_loss(reference(idx), targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        assert norm > 0.05  # the clipping is doing something
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1.0, "1", True])
def test_max_grad_norm_must_be_a_positive_number(bad):
    model, _ = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sample = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(xrt.InvalidInputError, match="max_grad_norm"):
        xpt.make_train_step(model, _lm_loss, opt, sample, max_grad_norm=bad)


@pytest.mark.parametrize("example", ["train_step_policy.py", "training_kernel_policy.py"])
def test_training_examples_run(example):
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / example
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if example == "train_step_policy.py":
        line = next(s for s in done.stdout.splitlines() if s.startswith("step:"))
        first, last = (float(x) for x in line.split("loss ")[1].split(" in ")[0].split(" -> "))
        assert last < first


def test_a_graphed_step_that_fails_over_a_batch_with_positions_points_to_packed_sequences():
    # The capture itself needs a GPU (tests/test_training_gpu.py); what the refusal adds,
    # and only where the batch gives positions and the policy does not say they are packed.
    from xpuruntime.policies import KernelPolicy
    from xpuruntime.pytorch._training._train_step import _packed_rows_hint

    positions = torch.arange(8)[None]
    hint = _packed_rows_hint({"input_ids": positions, "position_ids": positions}, KernelPolicy())
    assert "packed_sequences makes their documents on the device" in hint
    assert (
        _packed_rows_hint({"position_ids": positions}, KernelPolicy(packed_sequences=True)) is None
    )
    assert _packed_rows_hint({"input_ids": positions}, KernelPolicy()) is None
    assert _packed_rows_hint((positions, positions), KernelPolicy()) is None

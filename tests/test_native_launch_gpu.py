"""Our norms' launch plans run from C++ (ops/_native.py): derived without a launch or a
sync, bit for bit what the Python launches give whatever non-tensor arguments each call
brings, one autograd node per call with PyTorch's saved-tensor checks, and the Python
path wherever a plan does not fit (run by scripts/gpu-check; the C++ side is built on
first use)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._functional._residual import residual_layer_norm  # noqa: E402
from xpuruntime.pytorch._ops._infra import _native  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_kernel_policy")]


@pytest.fixture(autouse=True)
def _replayable():
    if _native.unavailable() is not None:
        pytest.skip(f"no native launches here: {_native.unavailable()}")
    xpt.set_kernel_policy(layernorm="fused", rmsnorm="fused", residual_layernorm="fused")


def _norm(kind, dim, dtype):
    torch.manual_seed(0)
    module = (xpt.nn.RMSNorm(dim, eps=1e-6) if kind == "rmsnorm" else xpt.nn.LayerNorm(dim)).to(
        "cuda", dtype
    )
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _reference(kind, module, x, r):
    """The op on the Python launch path: the public op, an autograd.Function."""
    if kind == "rmsnorm":
        return xpt.ops.fused_rmsnorm(x, module.normalized_shape, module.weight, module.eps)
    if kind == "residual":
        return xpt.ops.fused_add_layernorm(
            x, r, module.normalized_shape, module.weight, module.bias, module.eps
        )[1]
    return xpt.ops.fused_layernorm(x, module.normalized_shape, module.weight, module.bias)


def _routed(kind, module, x, r):
    if kind == "residual":
        return residual_layer_norm(x, r, module)[1]
    return module(x)


def _replayed(y) -> bool:
    """Whether ``y`` came from a replayed program's node (a C++ node named for our op)."""
    node = y.grad_fn
    return not isinstance(node, torch.autograd.function.BackwardCFunction) and (
        node.name().startswith("xpuruntime::")
    )


def _step(fn, leaves, seed):
    for t in leaves:
        t.grad = None
    y = fn()
    g = torch.randn(y.shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")
    y.backward(g.to(y.dtype))
    return y.detach(), [None if t.grad is None else t.grad.clone() for t in leaves], _replayed(y)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "residual"])
@pytest.mark.parametrize(
    ("shape", "dtype"), [((8, 768), torch.bfloat16), ((2, 33, 1024), torch.float32)]
)
def test_replayed_norms_give_the_python_launches_results(kind, shape, dtype):
    # Outputs and input gradients bit for bit; the parameter gradients' partial sums are
    # added by our kernel in a replay (as in a CUDA graph) and by Tensor.sum on the eager
    # Python path, both in fp32, so they may differ in the last bit.
    module = _norm("rmsnorm" if kind == "rmsnorm" else "layernorm", shape[-1], dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    leaves = [x, r, *module.parameters()]
    want = _step(lambda: _reference(kind, module, x, r), leaves, 1)
    for call in range(4):  # the first call runs the Python path; the second derives the plan
        got = _step(lambda: _routed(kind, module, x, r), leaves, 1)
        assert got[2] == (call > 0)  # then one C++ node per call
        assert torch.equal(got[0], want[0])
        for i, (g, w) in enumerate(zip(got[1], want[1])):
            assert (g is None) == (w is None)
            if g is not None and i < 2:
                assert torch.equal(g, w)
            elif g is not None:
                torch.testing.assert_close(
                    g, w, atol=1e-4, rtol=1e-5 if dtype == torch.float32 else 8e-3
                )


def test_a_call_the_plan_does_not_fit_runs_the_python_launches_and_is_right():
    norm = _norm("layernorm", 768, torch.bfloat16)
    x = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16)
    norm(x.requires_grad_())
    assert _replayed(norm(x))  # the plan of this signature
    transposed = torch.randn(768, 8, device="cuda", dtype=torch.bfloat16).t().requires_grad_()
    y = norm(transposed)
    assert not _replayed(y)
    want = torch.nn.functional.layer_norm(
        transposed.float(), (768,), norm.weight.float(), norm.bias.float()
    )
    torch.testing.assert_close(y.float(), want, atol=5e-2, rtol=2e-2)


def test_a_replayed_node_refuses_a_saved_input_modified_in_place():
    norm = _norm("layernorm", 256, torch.float32)
    a = torch.randn(4, 256, device="cuda", requires_grad=True)
    norm(a * 1), norm(a * 1)  # the plan
    x = a * 1
    y = norm(x)
    assert _replayed(y)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_replayed_node_keeps_its_graph_for_retain_graph_and_frees_it_after():
    norm = _norm("rmsnorm", 512, torch.float32)
    x = torch.randn(16, 512, device="cuda", requires_grad=True)
    norm(x)
    y = norm(x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_a_frozen_weight_gets_no_gradient_and_the_input_its_own():
    norm = _norm("layernorm", 384, torch.bfloat16)
    norm.weight.requires_grad_(False)
    x = torch.randn(6, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm(x)
    y = norm(x)
    assert _replayed(y)
    y.float().sum().backward()
    assert norm.weight.grad is None and norm.bias.grad is not None and x.grad is not None


def test_a_cuda_graph_captures_the_python_launches_and_replays_right():
    norm = _norm("layernorm", 768, torch.bfloat16)
    x = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm(x), norm(x)  # the plan, then a replayed call
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            norm(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = norm(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = xpt.ops.fused_layernorm(x, (768,), norm.weight, norm.bias)
    assert torch.equal(y, want)


def test_the_dispatch_log_sees_our_op_while_it_records():
    norm = _norm("layernorm", 128, torch.float32)
    x = torch.randn(4, 128, device="cuda", requires_grad=True)
    norm(x), norm(x)
    xpt.enable_dispatch_logging()
    y = norm(x)
    xpt.disable_dispatch_logging()
    assert not _replayed(y)
    ran = {r.context["aten_op"] for r in xpt.get_dispatch_logs() if "aten_op" in r.context}
    assert "xpuruntime::layer_norm" in ran


@pytest.mark.parametrize("bias_dtype", [torch.float32, None])
def test_the_replayed_gelu_backward_gives_the_python_launches_gradient(bias_dtype):
    from xpuruntime.pytorch._ops.fused_linear import _gelu_backward_launched, gelu_backward

    dh = torch.randn(8, 3072, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(8, 3072, device="cuda", dtype=torch.bfloat16)
    want = _gelu_backward_launched(dh, pre, "tanh", bias_dtype)
    for _ in range(3):  # the Python path, then the plan: derived, then replayed
        got = gelu_backward(dh, pre, "tanh", bias_dtype)
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (bias_dtype is None)
        if bias_dtype is not None:
            torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize(("first_eps", "later_eps"), [(0, 0.5), (1, 1e-5), (0.5, 0)])
def test_a_plan_takes_each_calls_eps_whatever_eps_derived_it(kind, first_eps, later_eps):
    # A recorded plan once froze an int eps (Triton compiles int 0 and 1 in) and replayed
    # it for another layer of the same shape: max error 1.3, no warning.
    cls = xpt.nn.RMSNorm if kind == "rmsnorm" else xpt.nn.LayerNorm
    first = cls(640, eps=first_eps).to("cuda", torch.bfloat16)
    later = cls(640, eps=later_eps).to("cuda", torch.bfloat16)
    x = (0.05 * torch.randn(8, 640, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    first(x), first(x)  # the plan of this signature, derived with first_eps
    y = later(x)
    assert _replayed(y)
    if kind == "rmsnorm":
        want = xpt.ops.fused_rmsnorm(x, (640,), later.weight, float(later_eps))
    else:
        want = xpt.ops.fused_layernorm(x, (640,), later.weight, later.bias, float(later_eps))
    assert torch.equal(y, want)


def test_a_forward_mode_tangent_is_not_dropped_by_a_plan():
    import torch.autograd.forward_ad as fwAD

    norm = _norm("layernorm", 256, torch.float32)
    x = torch.randn(4, 256, device="cuda")
    norm(x.requires_grad_()), norm(x), norm(x)  # the plan
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        try:
            y = norm(dual)
        except (NotImplementedError, RuntimeError) as e:  # the Python path says so
            assert "jvp" in str(e) or "forward" in str(e).lower()
            return
        assert fwAD.unpack_dual(y).tangent is not None


def test_deriving_a_plan_leaves_the_global_rng_alone():
    norm = _norm("layernorm", 200, torch.float32)
    x = torch.randn(4, 200, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(123)
    expected = torch.rand(8, device="cuda")
    norm(x)  # a signature's first call, on the Python path
    torch.cuda.manual_seed(123)
    norm(x)  # derives this signature's plan
    assert torch.equal(torch.rand(8, device="cuda"), expected)


def test_deriving_while_another_thread_launches_our_kernels_plans_only_its_own():
    import threading

    norm = _norm("rmsnorm", 320, torch.float32)
    other = torch.randn(64, 320, device="cuda")
    stop = threading.Event()
    errors = []

    def launch() -> None:
        try:
            while not stop.is_set():
                xpt.ops.fused_rmsnorm(other, (320,), norm.weight, 1e-6)
        except Exception as e:  # pragma: no cover - what the race did
            errors.append(e)

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        for rows in range(1, 31):  # 30 derivations, each of a new signature
            x = torch.randn(rows, 320, device="cuda", requires_grad=True)
            assert not _replayed(norm(x))  # a signature's first call: the Python path
            y = norm(x)
            assert _replayed(y), rows
            want = xpt.ops.fused_rmsnorm(x, (320,), norm.weight, norm.eps)
            assert torch.equal(y, want), rows
    finally:
        stop.set()
        thread.join(30)
    assert errors == []


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_the_public_ops_replay_their_plans_and_check_arguments_on_a_miss(kind):
    norm = _norm(kind, 512, torch.bfloat16)
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def public(t, weight=norm.weight):
        if kind == "rmsnorm":
            return xpt.ops.fused_rmsnorm(t, (512,), weight, 1e-6)
        return xpt.ops.fused_layernorm(t, (512,), weight, norm.bias, 1e-5)

    first = public(x)  # checked, run by the Python path
    second = public(x)  # derived, run by the plan
    y = public(x)
    assert not _replayed(first) and _replayed(second) and _replayed(y)
    assert torch.equal(y, first) and torch.equal(second, first)
    y.float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with pytest.raises(xrt.InvalidInputError):  # a wrong weight is a miss: checked, named
        public(x, torch.ones(7, device="cuda", dtype=torch.bfloat16))


def _python_path(kind, x, r, weight, bias, eps, out_dtype):
    """The op on its Python launches (the autograd.Function), never a plan."""
    from xpuruntime.pytorch._ops.fused_add_layernorm import run_add_layernorm
    from xpuruntime.pytorch._ops.fused_add_rmsnorm import run_add_rmsnorm
    from xpuruntime.pytorch._ops.fused_layernorm import run_layernorm
    from xpuruntime.pytorch._ops.fused_rmsnorm import run_rmsnorm

    n = x.shape[-1]
    if kind == "layernorm":
        return run_layernorm(x, n, weight, bias, eps, out_dtype)
    if kind == "rmsnorm":
        return run_rmsnorm(x, n, weight, eps, out_dtype)
    if kind == "add_layernorm":
        return run_add_layernorm(x, r, n, weight, bias, eps, out_dtype)[1]
    return run_add_rmsnorm(x, r, n, weight, eps, out_dtype)[1]


def _public(kind, x, r, weight, bias, eps, out_dtype):
    n = (x.shape[-1],)
    if kind == "layernorm":
        return xpt.ops.fused_layernorm(x, n, weight, bias, eps, out_dtype=out_dtype)
    if kind == "rmsnorm":
        return xpt.ops.fused_rmsnorm(x, n, weight, eps, out_dtype=out_dtype)
    if kind == "add_layernorm":
        return xpt.ops.fused_add_layernorm(x, r, n, weight, bias, eps, out_dtype=out_dtype)[1]
    return xpt.ops.fused_add_rmsnorm(x, r, n, weight, eps, out_dtype=out_dtype)[1]


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm"])
def test_every_non_tensor_argument_is_each_calls_own_through_the_plans(kind):
    # One shape, every other argument varied from call to call (eps int or float, the
    # parameters present or not, their dtype, the output dtype, which inputs need a
    # gradient): each call through the public op equals the Python launches bit for bit
    # (the parameters' gradients: to fp32 summation order). Where nothing needs a
    # gradient the Python path runs the forward kernel compiled without the statistics
    # and the plan the one with them: two binaries, equal to the last bit of fp32.
    generator = torch.Generator("cuda").manual_seed(0)
    rows, n = 12, 384

    def randn(dtype, *shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)

    variants = [
        (eps, with_weight, with_bias, param_dtype, out_dtype, grads)
        for eps in (0, 1, 1e-5, 0.5)
        for with_weight, with_bias in ((True, True), (True, False), (False, False))
        for param_dtype in (torch.bfloat16, torch.float32)
        for out_dtype in (None, torch.float32)
        for grads in ("all", "input", "params")
    ]
    for i, (eps, with_weight, with_bias, param_dtype, out_dtype, grads) in enumerate(variants):
        x0, r0 = 0.1 * randn(torch.bfloat16, rows, n), randn(torch.bfloat16, rows, n)
        w0 = randn(param_dtype, n) if with_weight else None
        b0 = randn(param_dtype, n) if with_bias and "rms" not in kind else None
        g = randn(torch.float32, rows, n)
        results = []
        for run in (_public, _python_path):
            x, r = (
                x0.clone().requires_grad_(grads != "params"),
                r0.clone().requires_grad_(grads != "params"),
            )
            w = None if w0 is None else w0.clone().requires_grad_(grads != "input")
            b = None if b0 is None else b0.clone().requires_grad_(grads != "input")
            total = torch.promote_types(x.dtype, r.dtype) if "add" in kind else x.dtype
            y = run(kind, x, r, w, b, eps, out_dtype or total)
            needs_grad = y.requires_grad
            if y.requires_grad:  # not without a weight when only the parameters need one
                y.backward(g.to(y.dtype))
            results.append([y.detach(), x.grad, r.grad, None if w is None else w.grad,
                            None if b is None else b.grad])  # fmt: skip
        (ours, theirs), where = (
            results,
            (kind, i, eps, with_weight, with_bias, param_dtype, out_dtype, grads),
        )
        for j, (a, b) in enumerate(zip(ours, theirs)):
            assert (a is None) == (b is None), where
            if a is not None and j < 3 and needs_grad:
                assert torch.equal(a, b), (where, j)
            elif a is not None and j < 3:
                torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2**-7)
            elif a is not None:
                torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)


def test_a_new_signature_runs_and_derives_its_plan_without_a_device_sync():
    norm = _norm("layernorm", 1536, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rows in (3, 5, 7):
            x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for call in range(2):  # the Python path, then the call that derives the plan
                y = norm(x)
                y.backward(torch.ones_like(y))
                assert _replayed(y) == (call == 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("transposed", [False, True])
def test_a_per_head_view_runs_from_its_plan_in_place_and_other_layouts_stay_right(transposed):
    # Qwen3's q norm: the heads of a slice of one joined q/k/v projection. The module's
    # plan is derived from the view (read in place, no copy) and replays it bit for bit;
    # a contiguous input of the same shape takes the Python launches, and is right too.
    norm = _norm("rmsnorm", 128, torch.bfloat16)
    joined = torch.randn(64, 32 * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shape = (4, 16, 16, 128) if transposed else (64, 16, 128)  # Gemma3's: after the transpose
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def run(x):
        joined.grad, norm.weight.grad = None, None
        y = norm(x)
        y.backward(g)
        return y.detach(), joined.grad.clone(), norm.weight.grad.clone(), _replayed(y)

    def view():
        heads = joined[:, : 16 * 128].view(64, 16, 128)
        return heads.view(4, 16, 16, 128).transpose(1, 2) if transposed else heads

    public = lambda: xpt.ops.fused_rmsnorm(view(), (128,), norm.weight, norm.eps)  # noqa: E731
    want_y, want_dx, want_dw = _python_launches(public, g, joined, norm)
    for call in range(3):
        y, dx, dw, replayed = run(view())
        assert replayed == (call > 0)
        assert torch.equal(y, want_y) and torch.equal(dx, want_dx)
        torch.testing.assert_close(dw, want_dw, atol=1e-4, rtol=8e-3)
    dense = view().detach().contiguous().requires_grad_()
    y = norm(dense)
    assert not _replayed(y) and torch.equal(y, want_y)


def _python_launches(fn, g, joined, norm):
    """``fn``, a public op's call, on the Python launches (a signature's first call)."""
    from xpuruntime.pytorch._ops.fused_rmsnorm import _public_plans

    _public_plans._table.clear()
    joined.grad, norm.weight.grad = None, None
    y = fn()
    assert not _replayed(y)
    y.backward(g)
    return y.detach(), joined.grad.clone(), norm.weight.grad.clone()


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "residual"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_op_saves_the_same_tensors_in_its_forward_and_its_recompute(kind, reentrant):
    """Activation checkpointing re-runs each segment's forward in the backward and (the
    non-reentrant kind) requires it to save what the first run saved. A signature's
    first call takes the Python launches and a later one its plan: under checkpointing
    both runs of a segment must take the same path, whatever the signature had seen."""
    from torch.utils.checkpoint import checkpoint

    dim = {"layernorm": 712, "rmsnorm": 728, "residual": 744}[kind] + 8 * reentrant  # new
    module = _norm("rmsnorm" if kind == "rmsnorm" else "layernorm", dim, torch.float32)
    x0 = torch.randn(4, 9, dim, device="cuda")
    r = torch.randn(4, 9, dim, device="cuda")

    def layers(x, checkpointed):
        for _ in range(3):  # one signature's first, second and third calls
            run = lambda t: _routed(kind, module, t, r) * 1.5  # noqa: E731
            x = checkpoint(run, x, use_reentrant=reentrant) if checkpointed else run(x)
        return x

    results = []
    for checkpointed in (True, False, True):  # before and after the plan exists
        module.zero_grad()
        x = x0.clone().requires_grad_()
        layers(x, checkpointed).square().sum().backward()
        results.append((x.grad, *(p.grad.clone() for p in module.parameters())))
    for got in (results[0], results[2]):
        for a, b in zip(got, results[1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_per_head_view_measured_under_best_performance_still_runs_from_its_plan(
    monkeypatch,
):
    """best_performance times the kernels on fresh (contiguous) samples; the chosen
    kernel's plan must come from the model's own calls (the per-head view), not from the
    timing's, or every later call of the view would take the Python launches."""
    from xpuruntime.pytorch._selection import _routed

    real = _routed.resolve_per_call

    def resolve(op, ctx, order, measure, unmeasured=None):
        def timed(kernel):  # each kernel timed for real, the fused one ranked first
            measure(kernel)
            return 1.0 if kernel.name == "fused" else 2.0

        return real(op, ctx, order, timed, unmeasured)

    monkeypatch.setattr(_routed, "resolve_per_call", resolve)
    xpt.set_kernel_policy(auto_strategy="best_performance")
    norm = _norm("rmsnorm", 128, torch.bfloat16)
    joined = torch.randn(48, 24 * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    replayed = []
    for _ in range(3):
        y = norm(joined[:, : 12 * 128].view(48, 12, 128))
        y.sum().backward()
        replayed.append(_replayed(y))
    assert replayed == [False, True, True]


@pytest.mark.parametrize(("offset", "interleaved"), [(0.0, False), (1.0, False), (0.0, True)])
@pytest.mark.parametrize("trained", [True, False])
def test_the_joined_head_norm_and_rope_replay_their_plan_as_the_python_launches_run(
    offset, interleaved, trained
):
    """Qwen3's q heads (a view of the joined projection, bf16), with Gemma's offset and
    the interleaved pairs too: from the second call the plan runs, with the output and
    the input's gradient bit for bit the Python launches'. A gradient handed back
    token-major (as attention hands it) or contiguous (copied to that layout) is read
    right either way."""
    from xpuruntime.pytorch._ops.norm_rope import _plans, run_norm_rope

    torch.manual_seed(0)
    batch, length, heads, width = 2, 64, 16, 128
    joined = torch.randn(batch, length, 3 * heads * width, device="cuda", dtype=torch.bfloat16)
    joined.requires_grad_()
    weight = torch.randn(width, device="cuda", dtype=torch.bfloat16).requires_grad_(trained)
    angle = torch.arange(length, device="cuda")[:, None] * torch.rand(width // 2, device="cuda")
    angle = torch.cat([angle, angle], -1)[None].expand(batch, -1, -1).contiguous()
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    token_major = torch.randn(batch, length, heads, width, device="cuda", dtype=torch.bfloat16)

    def run(g):
        joined.grad, weight.grad = None, None
        x = joined[..., : heads * width].view(batch, length, heads, width).transpose(1, 2)
        y = run_norm_rope(x, weight, cos, sin, 1e-6, offset, interleaved)
        y.backward(g)
        dw = None if weight.grad is None else weight.grad.clone()
        return y.detach(), joined.grad.clone(), dw, _replayed(y)

    _plans._table.clear()
    want_y, want_dx, want_dw, replayed = run(token_major.transpose(1, 2))
    assert not replayed
    for g in (token_major.transpose(1, 2), token_major.transpose(1, 2).contiguous()) * 2:
        y, dx, dw, replayed = run(g)
        assert replayed
        assert torch.equal(y, want_y) and torch.equal(dx, want_dx)
        if trained:  # (partial sums added by our kernel in a plan, by Tensor.sum in Python)
            torch.testing.assert_close(dw, want_dw, atol=1e-2, rtol=1e-2)
        else:
            assert dw is None

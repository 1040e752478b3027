"""What a launch plan may and may not take for granted (ops/_native.py,
ops/_cached_launch.py), checked where it can be without a GPU: every non-tensor
argument varied across calls of one shape agrees with PyTorch (on a GPU these calls go
through the plans, bit for bit the Python path's); plans are derived from the launchers
run dry (here with Triton's interpreter and a stand-in for its compiler, which the
interpreter does not have), named by where each tensor comes from, per thread, stopped
before any other PyTorch op runs; the off switch stops any build, and a builder killed
mid-build blocks nobody."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch._ops._infra import _cached_launch, _launch, _native  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- every non-tensor argument is the call's, never the first call's -------------------------
_NORM_VARIANTS = [
    # (kind, eps, affine): int eps 0 and 1 are what Triton specialises on
    ("layernorm", 0, True),
    ("layernorm", 0.5, True),
    ("layernorm", 1, True),
    ("layernorm", 1e-5, False),
    ("layernorm", 2.0, True),
    ("rmsnorm", 0, True),
    ("rmsnorm", 0.25, True),
    ("rmsnorm", 1, False),
    ("rmsnorm", None, True),
]


def _pair(kind, dim, eps, affine, dtype):
    """Our module and PyTorch's, with the same parameters."""
    if kind == "layernorm":
        ours = xpt.nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)
        theirs = torch.nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)
    else:
        ours = xpt.nn.RMSNorm(dim, eps=eps, elementwise_affine=affine)
        # eps=None means the input dtype's epsilon, not float64's
        same = torch.finfo(dtype).eps if eps is None else eps
        theirs = torch.nn.RMSNorm(dim, eps=same, elementwise_affine=affine)
    generator = torch.Generator().manual_seed(len(str(eps)))
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters()):
            p.copy_(torch.randn(p.shape, generator=generator))
            q.copy_(p)
    return ours.to(DEVICE, dtype), theirs.to(DEVICE, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_of_one_shape_with_every_eps_and_affinity_agree_with_pytorch(dtype):
    xpt.set_kernel_policy(layernorm="fused", rmsnorm="fused")
    dim, tolerance = 96, (2e-5 if dtype == torch.float32 else 3e-2)
    x0 = torch.randn(6, dim, generator=torch.Generator().manual_seed(0)) * 0.1  # eps matters
    for _ in range(2):  # the second pass runs every variant after its signature is planned
        for kind, eps, affine in _NORM_VARIANTS:
            ours, theirs = _pair(kind, dim, eps, affine, dtype)
            x = x0.to(DEVICE, dtype).detach().clone().requires_grad_()
            y = ours(x)
            y.backward(torch.ones_like(y))
            x64 = x0.to(DEVICE, torch.float64).detach().clone().requires_grad_()
            want = theirs(x64)
            want.backward(torch.ones_like(want))
            error = (y.double() - want).abs().max().item()
            assert error <= tolerance * (1 + want.abs().max().item()), (kind, eps, affine, error)
            grad_error = (x.grad.double() - x64.grad).abs().max().item()
            scale = 1 + x64.grad.abs().max().item()
            assert grad_error <= 10 * tolerance * scale, (kind, eps, affine, grad_error)


# -- plans derived from the launchers, run dry ----------------------------------------------
def _compiled_stand_in(fn, grid, args, kwargs):
    """What the planner reads of Triton's compiled kernel, from the interpreter's function:
    its parameters typed as Triton would from the values (the interpreter compiles
    nothing, so its warm-up returns None)."""
    params = inspect.signature(fn.fn).parameters
    values = {**dict(zip(fn.arg_names, args)), **kwargs}
    signature = {}
    for name, param in params.items():
        value = values.get(name, param.default)
        if param.annotation in (tl.constexpr, "tl.constexpr"):  # (a string under PEP 563)
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + str(value.dtype).removeprefix("torch.")
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    metadata = types.SimpleNamespace(
        num_ctas=1, launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
        profile_scratch_size=0, num_warps=kwargs.get("num_warps", 4), shared=0,
    )  # fmt: skip
    source = types.SimpleNamespace(
        signature=signature, fn=types.SimpleNamespace(arg_names=fn.arg_names)
    )
    return types.SimpleNamespace(metadata=metadata, src=source, function=id(fn), run=None,
                                 name=fn.fn.__name__)  # fmt: skip


@pytest.fixture
def dry_launches(monkeypatch):
    if not _launch.interpreting():
        pytest.skip("the stand-in compiler is for Triton's interpreter")
    monkeypatch.setattr(_cached_launch, "warmup", _compiled_stand_in)


def _program(spec):
    """A derived program read back: each launch's kernel and its tensor slots as table
    entries, and the number of buffers it allocates."""
    inputs, buffers, launches, outputs = spec
    slots = [
        (name, [entry for kind, entry, _ in slots if kind == 0]) for _, _, _, _, slots, name in launches
    ]  # fmt: skip
    return inputs, len(buffers), slots, [o[0] for o in outputs]


def test_a_layernorm_plan_names_each_tensor_by_where_it_comes_from(dry_launches):
    from xpuruntime.pytorch._ops.fused_layernorm import replay_layernorm

    replay = replay_layernorm(64)
    x, w, b = torch.randn(8, 64), torch.randn(64), torch.randn(64)
    before = [t.clone() for t in (x, w, b)]
    arguments, _ = _native.derive(replay.name, replay._reference, True, (x, w, b, None), x.dtype)
    _, _, forward, backward, results, out_dtype, _, sizes, strides, saved, _, grads, _, dys = (
        arguments
    )
    assert dys == [[]]  # (the result's gradient read contiguous)
    # forward: x, w, b given (0-2, 3 absent); y, mean, rstd allocated (4-6); r and h are x
    assert _program(forward) == (4, 3, [("_layernorm_fwd", [0, 0, 0, 4, 1, 2, 5, 6])], [4])
    # eps is the call's, a runtime slot: never the derivation's
    assert [kind for kind, _, _ in forward[2][0][4]].count(5) == 1
    # backward: dy given (0); x, w, mean, rstd saved from the forward (1-4); dx and the
    # partial sums allocated (5, 6), summed into the parameters' gradients (7)
    inputs, allocated, launches, outputs = _program(backward)
    assert (inputs, allocated) == (5, 3)
    assert launches == [("_layernorm_bwd", [0, 1, 2, 3, 4, 5, 5, 5, 6, 6]), ("_sum_rows", [6, 7])]
    assert outputs == [5, 7, 7] and saved == [0, 1, 5, 6] and grads == [0, 1, 2, -1]
    assert (results, out_dtype, sizes) == (1, x.dtype, [[8, 64], [64], [64], []])
    assert strides == [[], [], [], []]  # contiguous inputs: every call's must be too
    assert all(torch.equal(t, u) for t, u in zip((x, w, b), before))  # nothing ran


def test_an_fp8_cast_per_row_and_a_transpose_are_planned_from_their_launchers(dry_launches):
    # What FP8 GEMMs over a stored base launch each call: a cast per token (with the
    # row scales as a column multiplier and the amax its maker found, in parts) and the
    # stored bytes' transpose. Each plan allocates its outputs and launches one kernel.
    from xpuruntime.pytorch._ops import fp8

    t, m, parts = torch.randn(8, 64), torch.rand(64) + 0.5, torch.rand(8, 2) + 1.0
    before = [u.clone() for u in (t, m, parts)]
    plans = {}
    for name, reference, given, dtype in (
        ("cast_rows", fp8._cast_reference, (t, m, parts), fp8.E4M3),
        ("transpose", fp8._transpose_reference, (t, None, None), t.dtype),
    ):
        arguments, _ = _native.derive(name, reference, False, (*given, None), dtype)
        plans[name] = _program(arguments[2]), arguments[3]
    # given t, m, parts (0-2; 3 absent); the cast and its inverse scales allocated (4, 5)
    assert plans["cast_rows"][0] == (4, 2, [("_cast_rows", [0, 1, 2, 4, 5])], [4, 5])
    # the transpose: t given, its (64, 8) transpose a view of one buffer of t's elements
    assert plans["transpose"][0] == (4, 1, [("_transpose", [0, 4])], [4])
    assert all(_program(backward)[2] == [] for _, backward in plans.values())  # no backward
    assert all(torch.equal(u, v) for u, v in zip((t, m, parts), before))  # nothing ran


def test_a_per_head_view_is_planned_in_place_and_a_view_the_launchers_copy_is_refused(
    dry_launches,
):
    # A q/k norm's input: heads of a (tokens, heads * d) slice of a wider joined row. Its
    # plan takes the view itself (input 0, no copy) and holds its strides, which every
    # call must then match; a transposed input, which the launchers copy, stops the
    # derivation at the copy.
    from xpuruntime.pytorch._ops.fused_rmsnorm import replay_rmsnorm

    replay = replay_rmsnorm(16, strided=True)
    joined, w = torch.randn(6, 5 * 16), torch.randn(16)
    view = joined[:, : 3 * 16].view(6, 3, 16)
    arguments, _ = _native.derive(
        replay.name, replay._reference, True, (view, w, None, None), view.dtype
    )
    forward, strides = arguments[2], arguments[8]
    assert strides == [[80, 16, 1], [], [], []]
    ((name, slots),) = _program(forward)[2]
    assert name == "_rmsnorm_fwd" and slots[0] == 0  # x: the given view, read in place
    transposed = torch.randn(16, 6).t()
    with pytest.raises(_native._NotReplayable, match="clone"):
        _native.derive(replay.name, replay._reference, True, (transposed, w, None, None), w.dtype)


def test_the_joined_head_norm_and_rope_plan_reads_its_input_and_gradient_token_major(
    dry_launches,
):
    # Qwen3's q heads: a (B, H, T, D) view of the joined projection, read in place; the
    # output a view of token-major memory, whose gradient attention hands back so: the
    # backward is derived with that layout, not a contiguous copy of it.
    from xpuruntime.pytorch._ops.norm_rope import _plan

    batch, heads, length, width = 2, 3, 5, 16
    joined = torch.randn(batch, length, 5 * heads * width)
    x = joined[..., : heads * width].view(batch, length, heads, width).transpose(1, 2)
    w, cos, sin = (
        torch.randn(width),
        torch.randn(batch, length, width),
        torch.randn(batch, length, width),
    )
    replay = _plan((tuple(x.shape), x.stride(), x.dtype, -1, w.dtype, True, tuple(cos.shape),
                    cos.dtype, 1.0, False))  # fmt: skip
    arguments, _ = _native.derive(
        replay.name, replay._reference, True, (x, w, cos, sin), x.dtype, True
    )
    forward, backward, strides, dys = arguments[2], arguments[3], arguments[8], arguments[-1]
    assert strides == [list(x.stride()), [], [], []]
    assert dys == [[length * heads * width, width, heads * width, 1]]
    assert [name for name, _ in _program(forward)[2]] == ["_norm_rope_fwd"]
    assert [name for name, _ in _program(backward)[2]] == ["_norm_rope_bwd", "_sum_rows"]


def test_a_derivation_compiles_each_launch_and_launches_none(monkeypatch, dry_launches):
    from triton.runtime.interpreter import InterpretedFunction

    from xpuruntime.pytorch._ops.fused_rmsnorm import replay_rmsnorm

    launched = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    replay = replay_rmsnorm(32)
    x, w = torch.randn(4, 32), torch.randn(32)
    _, kernels = _native.derive(replay.name, replay._reference, True, (x, w, None, None), x.dtype)
    assert len(kernels) >= 2 and launched == []  # forward and backward compiled, none run
    xpt.ops.fused_rmsnorm(x, (32,), w)
    assert launched  # the Python path launches


def test_a_pytorch_op_between_launches_stops_the_derivation_before_it_runs(dry_launches):
    x = torch.ones(4, 8)

    def reference(t, scalar, out_dtype):
        t[0].add_(1)  # an in-place op a plan could not hold
        return t[0]

    with pytest.raises(_native._NotReplayable, match="add_"):
        _native.derive("xpuruntime::test", reference, False, (x, None, None, None), x.dtype)
    assert torch.equal(x, torch.ones(4, 8))


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm"])
def test_every_norm_plan_takes_eps_as_each_calls_own(op, dry_launches):
    from xpuruntime.pytorch._ops.fused_add_layernorm import replay_add_layernorm
    from xpuruntime.pytorch._ops.fused_add_rmsnorm import replay_add_rmsnorm
    from xpuruntime.pytorch._ops.fused_layernorm import replay_layernorm
    from xpuruntime.pytorch._ops.fused_rmsnorm import replay_rmsnorm

    make = {
        "layernorm": replay_layernorm,
        "rmsnorm": replay_rmsnorm,
        "add_layernorm": replay_add_layernorm,
        "add_rmsnorm": replay_add_rmsnorm,
    }[op]
    replay = make(48)
    x, r, w, b = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48), torch.randn(48)
    tensors = {
        "layernorm": (x, w, b, None),
        "rmsnorm": (x, w, None, None),
        "add_layernorm": (x, r, w, b),
        "add_rmsnorm": (x, r, w, None),
    }[op]
    arguments, _ = _native.derive(replay.name, replay._reference, True, tensors, x.dtype)
    forward_slots = [kind for launch in arguments[2][2] for kind, _, _ in launch[4]]
    assert forward_slots.count(5) == 1  # one float, the call's eps, a runtime slot


def test_a_float_other_than_the_calls_scalar_refuses_the_plan(dry_launches):
    from xpuruntime.pytorch._ops.fused_rmsnorm import run_rmsnorm

    x, w = torch.randn(4, 32), torch.randn(32)

    def reference(t, eps, out_dtype):  # a float no plan could give each call
        return run_rmsnorm(t[0], 32, t[1], eps * 2, out_dtype)

    with pytest.raises(_native._NotReplayable, match="parameter eps of type fp32"):
        _native.derive("xpuruntime::test", reference, True, (x, w, None, None), x.dtype)


def test_a_derivation_plans_only_its_own_threads_launches(dry_launches):
    from xpuruntime.pytorch._ops.fused_rmsnorm import replay_rmsnorm

    w = torch.randn(32)
    other = torch.randn(16, 32)
    stop = threading.Event()
    results = []

    def launch() -> None:  # the Python path, launched while the main thread derives
        while not stop.is_set():
            results.append(xpt.ops.fused_rmsnorm(other, (32,), w, 1e-6))

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        for rows in (1, 2, 3):
            replay = replay_rmsnorm(32)
            x = torch.randn(rows, 32)
            arguments, _ = _native.derive(
                replay.name, replay._reference, True, (x, w, None, None), x.dtype
            )
            assert len(arguments[2][2]) == 1  # the forward: one launch, this thread's
    finally:
        stop.set()
        thread.join(60)
    want = torch.nn.functional.rms_norm(other, (32,), w, 1e-6)
    assert results and all(torch.allclose(r, want, atol=1e-5) for r in results)


def test_planning_is_per_thread():
    seen: dict[str, bool] = {}
    planning = threading.Event()
    checked = threading.Event()

    def other_thread() -> None:
        planning.wait(5)
        seen["other"] = _cached_launch.planning()
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    _cached_launch.plan_launches([])
    try:
        planning.set()
        checked.wait(5)
        seen["mine"] = _cached_launch.planning()
    finally:
        _cached_launch.plan_launches(None)
    thread.join(5)
    assert seen == {"other": False, "mine": True}


def test_a_plan_table_keeps_at_most_its_size():
    made = []
    table = _native.PlanTable(lambda key: made.append(key) or key, size=3)
    for key in range(5):
        table.get(key)
    assert [table.find(key) for key in range(5)] == [None, None, 2, 3, 4]


# -- the off switch and the build --------------------------------------------------------------
def test_the_off_switch_is_read_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setenv("XPURUNTIME_NATIVE_LAUNCH", "0")
    monkeypatch.setattr(_native, "_extension", lambda: built.append(1))
    replay = _native.Replay("xpuruntime::test", lambda t, s, d: t[0] * 2)
    x = torch.ones(4, 8, device=DEVICE)
    for _ in range(2):  # a signature's first call, then the one that would derive
        assert replay.call(x, None, None, None, 1e-5, x.dtype) is None
    assert built == []
    assert _native.unavailable() == "XPURUNTIME_NATIVE_LAUNCH=0"


def test_the_ahead_of_time_build_says_why_it_cannot_build():
    env = {**os.environ, "XPURUNTIME_NATIVE_LAUNCH": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "xpuruntime.pytorch.build"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "XPURUNTIME_NATIVE_LAUNCH=0" in done.stderr


_DYING_BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from xpuruntime.pytorch._ops._infra import _native

    directory = Path(sys.argv[1])
    with _native._build_lock(directory, 10):
        (directory / "lock").write_text("")  # PyTorch's baton, as cpp_extension leaves it
        print("building", flush=True)
        time.sleep(600)
    """
)


def _start_builder(directory) -> subprocess.Popen:
    builder = subprocess.Popen(
        [sys.executable, "-c", _DYING_BUILDER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert builder.stdout.readline().strip() == "building"
    return builder


def test_a_builder_killed_mid_build_blocks_no_later_build(tmp_path):
    builder = _start_builder(tmp_path)
    builder.kill()  # an OOM kill or a scheduler's: no cleanup runs
    builder.wait(10)
    assert (tmp_path / "lock").exists()
    start = time.monotonic()
    with _native._build_lock(tmp_path, wait=30):
        assert not (tmp_path / "lock").exists()  # the dead builder's baton is gone
    assert time.monotonic() - start < 5


def test_a_wait_for_a_live_builder_ends_with_the_reason(tmp_path):
    builder = _start_builder(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="held .* for over 1 s"):
            with _native._build_lock(tmp_path, wait=1.0):
                pass
        assert time.monotonic() - start < 10
    finally:
        builder.kill()
        builder.wait(10)

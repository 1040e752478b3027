"""What a replayed launch plan may and may not take for granted (ops/_native.py,
ops/_cached_launch.py), checked where it can be without a GPU: every non-tensor
argument varied across calls of one shape agrees with PyTorch (on a GPU these calls go
through the replayed plans, bit for bit the Python path's), recordings are per thread,
the off switch stops any build, and a builder killed mid-build blocks nobody."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.pytorch.ops import _cached_launch, _native  # noqa: E402

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


# -- recordings are per thread ---------------------------------------------------------------
def test_a_recording_sees_only_its_own_threads_launches():
    seen: dict[str, bool] = {}
    recording = threading.Event()
    checked = threading.Event()

    def other_thread() -> None:
        recording.wait(5)
        seen["other"] = _cached_launch.launches_recorded()
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    _cached_launch.record_launches([])
    try:
        recording.set()
        checked.wait(5)
        seen["mine"] = _cached_launch.launches_recorded()
    finally:
        _cached_launch.record_launches(None)
    thread.join(5)
    assert seen == {"other": False, "mine": True}


# -- the off switch and the build --------------------------------------------------------------
def test_the_off_switch_is_read_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setenv("XPURUNTIME_NATIVE_LAUNCH", "0")
    monkeypatch.setattr(_native, "_extension", lambda: built.append(1))
    replay = _native.Replay("xpuruntime::test", lambda t, s, d: t[0] * 2)
    x = torch.ones(4, 8, device=DEVICE)
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
    from xpuruntime.pytorch.ops import _native

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

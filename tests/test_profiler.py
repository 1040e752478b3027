"""The Profiler: ranges from user code, sessions and the dispatcher in one Chrome trace."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import xpuruntime as xrt


@pytest.fixture
def profiler():
    prof = xrt.Profiler.instance()
    prof.clear()
    prof.enable()
    yield prof
    prof.disable()
    prof.clear()


def test_ranges_nest_and_export_as_a_chrome_trace(profiler, tmp_path):
    with profiler.range("outer", batch=8):
        profiler.push_range("inner", "user", step=1)
        assert profiler.pop_range() >= 0.0
    path = profiler.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    outer, inner = spans["outer"], spans["inner"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert outer["args"] == {"batch": 8} and inner["args"] == {"step": 1}
    assert profiler.summary()["outer"]["count"] == 1


def test_pop_without_a_range_is_an_error(profiler):
    with pytest.raises(xrt.InvalidInputError, match="no range is open"):
        profiler.pop_range()


def test_nothing_is_recorded_while_disabled(profiler):
    profiler.disable()
    with profiler.range("ignored"):
        profiler.instant("ignored too")
    assert profiler.events == []


def test_each_thread_keeps_its_own_range_stack(profiler):
    barrier = threading.Barrier(4)

    def work(name):
        with profiler.range(name):
            barrier.wait()  # all four alive at once, so no thread id is reused

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tids = {e["tid"] for e in profiler.events if e["name"].startswith("t")}
    assert len(tids) == 4


def test_sessions_and_engine_decisions_report_into_the_profiler(profiler, mlp_model):
    session = xrt.InferenceSession(mlp_model, engine="onnxrt")
    session.run({"x": np.ones((2, 16), np.float32)})
    names = [e["name"] for e in profiler.events]
    assert "session.load" in names
    assert "engine.build onnxrt" in names
    assert "decide engine: onnxrt" in names
    assert "session.run onnxrt" in names
    decision = next(e for e in profiler.events if e["name"] == "decide engine: onnxrt")
    assert decision["ph"] == "i" and decision["args"]["source"] == "policy"


_NVTX_CHILD = """
import json, sys
import xpuruntime as xrt
from xpuruntime.pytorch._selection import _ranges
import torch
from xpuruntime import pytorch as xpt
prof = xrt.Profiler.instance()
with prof.range("outer"):  # an NVTX range too, when a tool listens
    pass
q = torch.randn(1, 2, 8, 16)
xpt.set_kernel_policy(attention="math")
out = xpt.ops.fused_attention(q, q, q)
print(json.dumps({"nvtx": prof.nvtx, "ranges": _ranges.ranges_active(), "shape": list(out.shape)}))
"""


@pytest.mark.parametrize("attached", [False, True], ids=["no tool", "tool attached"])
def test_nvtx_ranges_are_emitted_only_while_an_nvtx_tool_is_attached(attached):
    # Without a tool NVTX records nothing, but every range would still cost a push and a
    # pop; and fused_attention's cheap call path is skipped whenever ranges are recorded.
    pytest.importorskip("nvtx")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTX_INJECTION")}
    if attached:  # how Nsight Systems attaches; a missing library leaves NVTX inert
        env["NVTX_INJECTION64_PATH"] = "/nonexistent/libToolsInjection64.so"
    out = subprocess.run(
        [sys.executable, "-c", _NVTX_CHILD], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"nvtx": attached, "ranges": attached, "shape": [1, 2, 8, 16]}


_NCU_CHILD = """
import torch, xpuruntime as xrt
x = torch.randn(1024, 1024, device="cuda")
torch.cuda.synchronize()
with xrt.Profiler.instance().range("marked"):
    x @ x
torch.relu(x)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_nsight_compute_sees_our_nvtx_ranges():
    # Nsight Compute attaches to NVTX as Nsight Systems does; told to profile only the
    # kernels inside our range, it must find the matmul there and nothing else.
    pytest.importorskip("nvtx")
    ncu = shutil.which("ncu")
    if ncu is None:
        pytest.skip("Nsight Compute (ncu) is not installed")
    out = subprocess.run(
        [ncu, "--nvtx", "--nvtx-include", "xpuruntime@marked/", "--metrics",
         "gpu__time_duration.sum", sys.executable, "-c", _NCU_CHILD],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    kernels = re.findall(
        r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context", out.stdout, re.M
    )
    assert len(kernels) == 1 and "gemm" in kernels[0], out.stdout[-2000:]

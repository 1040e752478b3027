"""Where a training step's GPU waits for the host: the idle gaps between its kernels in a
profiler trace, each put down to the step's phase and the host op that launched the
kernel ending it.

A plain training loop is as fast as its kernels only while the host stays ahead of the
GPU. Where it falls behind (small kernels, Python between them, an optimizer's host
work), the GPU idles. This reads a Chrome trace of ``torch.profiler`` with CPU and CUDA
activity, as ``train_hf.py --profile N`` writes one per rank where ``XRT_TRACE_DIR`` is
set (its steps annotated ``forward``, ``backward`` and ``optimizer``), and prints:

- the kernels' busy time and the idle time between them (all streams together);
- the idle time by phase: a gap belongs to the phase in which the host launched the
  kernel that ends it;
- the largest gaps, each with that kernel and the innermost host op around its launch.

Usage: ``python benchmarks/trace_gaps.py TRACE.json [--top 15]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
PHASES = ("forward", "backward", "optimizer")


def gaps(trace: dict, top: int = 15) -> dict:
    """The busy and idle microseconds of the trace's GPU work, the idle time by phase
    and the ``top`` largest gaps (see the module's text)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        return {"busy_us": 0.0, "idle_us": 0.0, "by_phase": {}, "largest": []}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    phases = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"] in PHASES),
        key=lambda e: e["ts"],
    )
    host_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    phase_starts, op_starts = [r["ts"] for r in phases], [r["ts"] for r in host_ops]
    busy = idle = 0.0
    by_phase: dict[str, float] = defaultdict(float)
    largest = []
    end = gpu[0]["ts"]
    for e in gpu:
        start = e["ts"]
        if start > end:  # the GPU waited from ``end`` to this kernel
            wait = start - end
            idle += wait
            launch = launches.get(e.get("args", {}).get("correlation"))
            at = None if launch is None else launch["ts"]
            phase = _around(phases, phase_starts, at, innermost=False)
            by_phase[phase] += wait
            op = _around(host_ops, op_starts, at, innermost=True)
            largest.append((wait, phase, e["name"], op))
        busy += max(0.0, start + e["dur"] - max(start, end))
        end = max(end, start + e["dur"])
    largest.sort(key=lambda g: -g[0])
    return {
        "busy_us": busy,
        "idle_us": idle,
        "by_phase": dict(by_phase),
        "largest": largest[:top],
    }


def _around(ranges: list[dict], starts: list[float], at: float | None, innermost: bool) -> str:
    """The name of a range of ``ranges`` (sorted by their ``starts``) holding time
    ``at``: the latest-starting one with ``innermost`` (looked for backwards from
    ``at``, so near it), else the earliest; ``?`` for none."""
    if at is None:
        return "?"
    count = bisect.bisect_right(starts, at)  # the ranges starting by ``at``
    for i in range(count - 1, -1, -1) if innermost else range(count):
        if at <= ranges[i]["ts"] + ranges[i]["dur"]:
            return ranges[i]["name"]
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace of torch.profiler (CPU and CUDA)")
    parser.add_argument("--top", type=int, default=15, help="how many of the largest gaps")
    args = parser.parse_args()
    with open(args.trace) as f:
        found = gaps(json.load(f), args.top)
    total = found["busy_us"] + found["idle_us"]
    print(f"GPU busy {found['busy_us'] / 1e3:.1f} ms, idle {found['idle_us'] / 1e3:.1f} ms "
          f"({100 * found['idle_us'] / max(total, 1):.1f}% of the kernels' span)")  # fmt: skip
    for phase, wait in sorted(found["by_phase"].items(), key=lambda p: -p[1]):
        print(f"  idle in {phase}: {wait / 1e3:.2f} ms")
    print("largest gaps (us, phase, kernel after it, host op launching it):")
    for wait, phase, kernel, op in found["largest"]:
        print(f"  {wait:8.1f}  {phase:9s}  {kernel[:60]:60s}  {op[:50]}")


if __name__ == "__main__":
    main()

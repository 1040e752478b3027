"""Session overhead: xrt.InferenceSession.run vs raw onnxruntime.InferenceSession.run.

Both run the same small model on the CPU with the same options; calls are interleaved
(A, B, A, B, ...) in one run so that drift hits both equally. Prints p50 latencies and
the ratio xrt / raw (goal: <= 1.03), plus the cost of `import xpuruntime`.

    python benchmarks/bench_session_overhead.py [--batch 8] [--rounds 20000]
"""

import argparse
import platform
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()

    model = demo_model_path()
    feeds = {"image": np.random.default_rng(0).standard_normal((args.batch, 3, 32, 32), np.float32)}
    session = xrt.InferenceSession(model, engine="onnxrt", policy={"threads": 1})
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    raw = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    assert np.array_equal(session.run(feeds)[0], raw.run(None, feeds)[0])

    ours, theirs = [], []
    for _ in range(200):  # warm-up
        session.run(feeds)
        raw.run(None, feeds)
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        session.run(feeds)
        t1 = time.perf_counter()
        raw.run(None, feeds)
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    p50_ours, p50_raw = np.median(ours) * 1e6, np.median(theirs) * 1e6

    imports = []
    for _ in range(5):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time; t=time.perf_counter(); import xpuruntime; "
                "print(time.perf_counter()-t)",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        imports.append(float(out.stdout))

    print(
        f"# {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}, "
        f"demo CNN batch {args.batch}, {args.rounds} interleaved rounds, 1 thread"
    )
    print("| what | p50 µs | ratio to raw ORT |")
    print("| --- | --- | --- |")
    print(f"| raw onnxruntime.InferenceSession.run | {p50_raw:.1f} | 1.000 |")
    print(f"| xrt.InferenceSession.run | {p50_ours:.1f} | {p50_ours / p50_raw:.3f} |")
    print(f"| overhead per call | {p50_ours - p50_raw:.1f} | |")
    print(f"\nimport xpuruntime: median {np.median(imports) * 1e3:.0f} ms over 5 fresh processes")


if __name__ == "__main__":
    main()

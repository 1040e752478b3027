"""Session overhead: xrt.InferenceSession.run vs raw onnxruntime.InferenceSession.run.

Three models where a per-call cost would show: the demo CNN (batch 8), a 3-layer
256-wide MLP (batch 1, tens of microseconds a call), and a stateful voice-activity-style
model with a rank-0 int64 input and a recurrent state. Both sessions use the same
options (one intra-op thread); calls are interleaved in alternating order (A B, B A,
...) in one run so that drift and cache effects hit both equally; inputs pass xrt's validation on every call. Prints p50
latencies and the ratio xrt / raw (goal: <= 1.03), plus the cost of
``import xpuruntime``.

    python benchmarks/bench_session_overhead.py [--rounds 20000]
"""

import argparse
import platform
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path


def mlp_model() -> tuple[bytes, dict[str, np.ndarray]]:
    """x[batch, 256] -> 3 x (Gemm 256 -> Relu)."""
    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for i in range(3):
        weights += [
            numpy_helper.from_array(rng.standard_normal((256, 256), np.float32) * 0.05, f"w{i}"),
            numpy_helper.from_array(np.zeros(256, np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("Gemm", [previous, f"w{i}", f"b{i}"], [f"h{i}"]),
            helper.make_node("Relu", [f"h{i}"], [f"a{i}"]),
        ]
        previous = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", 256])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return model.SerializeToString(), {"x": rng.standard_normal((1, 256), np.float32)}


def stateful_model() -> tuple[bytes, dict[str, np.ndarray]]:
    """A voice-activity-style step: audio chunk x[1, 512], state[2, 1, 128] and the
    sample rate sr (rank-0 int64) -> probability[1, 1] and the next state."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((512, 128), np.float32) * 0.05, "w")
    u = numpy_helper.from_array(rng.standard_normal((128, 1), np.float32) * 0.05, "u")
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    nodes = [
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["x", "srf"], ["xs"]),
        helper.make_node("MatMul", ["xs", "w"], ["h"]),
        helper.make_node("ReduceMean", ["state"], ["s"], axes=[0], keepdims=0),
        helper.make_node("Add", ["h", "s"], ["hs"]),
        helper.make_node("Tanh", ["hs"], ["t"]),
        helper.make_node("Unsqueeze", ["t", "zero"], ["t3"]),
        helper.make_node("Concat", ["t3", "t3"], ["next_state"], axis=0),
        helper.make_node("MatMul", ["t", "u"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["probability"]),
    ]
    graph = helper.make_graph(
        nodes,
        "vad",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, 128]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("probability", TensorProto.FLOAT, [1, 1]),
            helper.make_tensor_value_info("next_state", TensorProto.FLOAT, [2, 1, 128]),
        ],
        [w, u, zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    feeds = {
        "x": rng.standard_normal((1, 512), np.float32),
        "state": np.zeros((2, 1, 128), np.float32),
        "sr": np.array(16000, np.int64),
    }
    return model.SerializeToString(), feeds


def demo_model() -> tuple[bytes, dict[str, np.ndarray]]:
    feeds = {"image": np.random.default_rng(0).standard_normal((8, 3, 32, 32), np.float32)}
    return demo_model_path().read_bytes(), feeds


def measure(model: bytes, feeds: dict[str, np.ndarray], rounds: int) -> tuple[float, float]:
    session = xrt.InferenceSession(model, engine="onnxrt", policy={"threads": 1})
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    raw = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    for ours, theirs in zip(session.run(feeds), raw.run(None, feeds)):
        if not (ours.shape == theirs.shape and np.array_equal(ours, theirs)):
            raise SystemExit("xrt and raw onnxruntime disagree")
    ours, theirs = [], []
    for _ in range(500):  # warm-up
        session.run(feeds)
        raw.run(None, feeds)
    calls = ((ours, lambda: session.run(feeds)), (theirs, lambda: raw.run(None, feeds)))
    for round_ in range(rounds):
        for samples, call in calls if round_ % 2 else calls[::-1]:  # A B, B A, ...
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
    return float(np.median(ours)) * 1e6, float(np.median(theirs)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()

    print(
        f"# {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}, "
        f"{args.rounds} interleaved rounds, 1 intra-op thread"
    )
    print("| model | raw ORT p50 µs | xrt p50 µs | overhead µs | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for label, make in (
        ("demo CNN, batch 8", demo_model),
        ("MLP 3x256, batch 1", mlp_model),
        ("stateful, rank-0 int64 input", stateful_model),
    ):
        ours, raw = measure(*make(), args.rounds)
        print(f"| {label} | {raw:.1f} | {ours:.1f} | {ours - raw:+.1f} | {ours / raw:.3f} |")

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
    print(f"\nimport xpuruntime: median {np.median(imports) * 1e3:.0f} ms over 5 fresh processes")


if __name__ == "__main__":
    main()

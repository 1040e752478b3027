"""Write the small CNN that ships in the package (src/xpuruntime/models/demo_cnn.onnx).

Deterministic: the same weights every time (seed 0). Run from the repository root:
    python scripts/make_demo_model.py
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parents[1] / "src" / "xpuruntime" / "models" / "demo_cnn.onnx"


def he(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(0)
    weights = {
        "conv1.w": he(rng, (16, 3, 3, 3), 27),
        "conv1.b": np.zeros(16, np.float32),
        "conv2.w": he(rng, (32, 16, 3, 3), 144),
        "conv2.b": np.zeros(32, np.float32),
        "fc.w": he(rng, (32, 10), 32),
        "fc.b": np.zeros(10, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["image", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node(
            "Conv", ["r1", "conv2.w", "conv2.b"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]
        ),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"]),
        helper.make_node("Gemm", ["features", "fc.w", "fc.b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "demo_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    # IR 10 / opset 17: loadable by every ONNX Runtime and OpenVINO release we support.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(model.SerializeToString())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

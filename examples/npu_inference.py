"""Run a model on a Qualcomm NPU through the QNN engine, and say which nodes ran where.

    python examples/npu_inference.py [MODEL.onnx]

With onnxruntime-qnn installed (``pip install "xpuruntime[qnn]"``) the model runs on
QNN's HTP backend: on a Snapdragon NPU, or, on Linux x86_64, in Qualcomm's emulation on
the host CPU (said as such: emulation measures nothing about NPU speed). The engine is
asked for strictly, so an op QNN lacks is an error naming it; the example then shows
the same model with CPU fallback allowed, where the session reports the nodes that left
the NPU. Without onnxruntime-qnn, the error says what to install.
"""

import sys

import numpy as np

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path

model = sys.argv[1] if len(sys.argv) > 1 else demo_model_path()
spec = xrt.inference.Model.load(model)
# QNN compiles static shapes: the sample inputs fix the dynamic ones (batch 1 here).
inputs = xrt.inference.generate_inputs(spec.inputs, seed=0)

try:
    session = xrt.InferenceSession(
        model,
        engine="qnn",
        device="npu",
        policy={"strict": True, "accuracy": {"rtol": 1e-2, "atol": 1e-3}},
        sample_inputs=inputs,
    )
except xrt.BackendUnavailableError as e:
    sys.exit(f"QNN is not available here: {e}")
except xrt.UnsupportedOperationError as e:
    print(f"strict: {e}\n")
    session = xrt.InferenceSession(model, engine="qnn", device="npu", sample_inputs=inputs)

outputs = session.run(inputs)
reference = xrt.InferenceSession(model, engine="onnxrt").run(inputs)
print(session.explain())
print("\nwhere the nodes ran:", session.engine_settings["placement"])
print("runs on:", session.engine_settings["device"])
worst = max(float(np.max(np.abs(o - r))) for o, r in zip(outputs, reference))
print(f"max abs difference from ONNX Runtime on the CPU: {worst:.3g}")

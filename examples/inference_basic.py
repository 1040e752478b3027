"""Run an ONNX model through xpuruntime: a policy, the engine decision, outputs, accuracy.

    python examples/inference_basic.py [MODEL.onnx]

Without an argument it uses the small CNN bundled with the package.
"""

import sys

import numpy as np

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path

model = sys.argv[1] if len(sys.argv) > 1 else demo_model_path()

policy = xrt.ExecutionPolicy(
    engine="auto",
    device="cpu",
    precision="fp32",
    auto_strategy="best_performance",  # measured once on these shapes, then cached on disk
    accuracy={"rtol": 1e-3, "atol": 1e-4},  # engines that miss this vs ORT fp32 are skipped
)
inputs = xrt.inference.generate_inputs(xrt.inference.Model.load(model).inputs, seed=0)

with xrt.InferenceSession(model, policy=policy, sample_inputs=inputs) as session:
    print("inputs: ", ", ".join(str(spec) for spec in session.inputs))
    print("outputs:", ", ".join(str(spec) for spec in session.outputs))
    print(session.explain())
    for spec, value in zip(session.outputs, session.run(inputs)):
        print(f"{spec.name}: shape {value.shape}, mean {np.mean(value):.4g}")

print(xrt.compare(model, engines=["onnxrt", "openvino"], inputs=inputs))

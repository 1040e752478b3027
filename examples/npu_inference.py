"""Run a model on an NPU when one is present (OpenVINO NPU or Qualcomm QNN), else on the CPU.

    python examples/npu_inference.py [MODEL.onnx]

The NPU is asked for strictly: if it cannot run the model, the error says why, and the
example then runs on the CPU and says so. Nothing falls back silently.
"""

import sys

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path

model = sys.argv[1] if len(sys.argv) > 1 else demo_model_path()
inputs = xrt.inference.generate_inputs(xrt.inference.Model.load(model).inputs, seed=0)

npus = [d for d in xrt.get_all_devices() if d.kind == "npu"]
if npus:
    print(f"NPU found: {npus[0]} ({npus[0].name})")
    try:
        session = xrt.InferenceSession(
            model, device=npus[0], policy={"strict": True, "precision": "default"}
        )
    except xrt.XpuRuntimeError as e:
        print(f"the NPU cannot run this model: {type(e).__name__}: {e}")
        session = None
else:
    reasons = "; ".join(
        f"{r.backend}: {r.detail}"
        for r in xrt.DeviceManager.instance().probes
        if r.backend in ("openvino", "onnxruntime")
    )
    print(f"no NPU on this machine ({reasons}); running on the CPU")
    session = None

session = session or xrt.InferenceSession(model, device="cpu")
outputs = session.run(inputs)
print(session.explain())
print("output shapes:", [o.shape for o in outputs])

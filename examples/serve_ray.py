"""Serve a model with Ray Serve: replicas holding one session each, requests batched.

    python examples/serve_ray.py            # a local cluster of 2 CPUs; the same code on a cluster

Starts the deployment, sends requests through its handle and over HTTP, and prints
each answer's agreement with a single session and a replica's engine decision.
"""

import json
import urllib.request

import numpy as np
import ray
from ray import serve

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path
from xpuruntime.serving import deployment

MODEL = str(demo_model_path())

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
app = deployment(MODEL, engine="onnxrt", num_replicas=2, num_cpus=0.5, max_batch_size=16)
handle = serve.run(app, name="demo", route_prefix="/demo")

reference = xrt.InferenceSession(MODEL, engine="onnxrt")
x = np.random.default_rng(0).standard_normal((4, 3, 32, 32), np.float32)
answers = [handle.predict.remote({"image": x[i : i + 1]}) for i in range(4)]  # batched
got = np.concatenate([a.result()["probabilities"] for a in answers])
print("handle: equal to one session:", np.array_equal(got, reference.run({"image": x})[0]))

body = json.dumps({"inputs": {"image": x.tolist()}}).encode()
request = urllib.request.Request(
    "http://127.0.0.1:8000/demo", data=body, headers={"Content-Type": "application/json"}
)
answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
http = np.asarray(answer["outputs"]["probabilities"], np.float32)
print("HTTP: max abs difference:", float(np.max(np.abs(http - reference.run({"image": x})[0]))))
decision = handle.decision.remote().result()
print(f"replica decision: engine {decision['engine']} ({decision['source']}): {decision['reason']}")
serve.shutdown()
ray.shutdown()

"""Offline batch inference with Ray Data: one session per actor, batches of numpy rows.

    python examples/batch_infer_ray.py      # a local cluster of 2 CPUs; the same code on a cluster

Scores 4000 images of the demo model with two actors and checks the result against a
single session run over the same rows.
"""

import time

import numpy as np
import ray

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path
from xpuruntime.serving import Predictor

MODEL = str(demo_model_path())

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
ray.data.DataContext.get_current().execution_options.preserve_order = True
images = np.random.default_rng(0).standard_normal((4000, 3, 32, 32)).astype(np.float32)
dataset = ray.data.from_numpy(images).map_batches(
    Predictor,
    fn_constructor_kwargs={"model": MODEL, "engine": "onnxrt", "columns": {"image": "data"}},
    concurrency=2,
    num_cpus=1,
    batch_size=256,
    batch_format="numpy",
)
started = time.perf_counter()
scores = np.concatenate(
    [b["probabilities"] for b in dataset.iter_batches(batch_size=None, batch_format="numpy")]
)
seconds = time.perf_counter() - started
single = xrt.InferenceSession(MODEL, engine="onnxrt").run({"image": images})[0]
print(f"{len(scores)} rows in {seconds:.2f} s ({len(scores) / seconds:.0f} rows/s) on 2 actors")
print("equal to one session:", np.array_equal(scores, single))
ray.shutdown()

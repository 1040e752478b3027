"""Inference scale-out on Ray, on this machine's CPUs: Ray Data throughput with 1 and 2
actors against a plain loop over one session (the anchor), and Ray Serve latency under
a bounded load, all in one run.

    python benchmarks/bench_ray.py [--rows 8000] [--requests 400] [--concurrency 8]

The demo CNN; every path runs ONNX Runtime with one intra-op thread per session, so
that the actors' gain is the parallelism Ray adds, not threads inside a session.
"""

import argparse
import asyncio
import os
import platform
import statistics
import time

import numpy as np
import ray
from ray import serve

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path
from xpuruntime.serving import Predictor, deployment

MODEL = str(demo_model_path())
POLICY = {"threads": 1}


def plain_loop(images: np.ndarray, batch: int) -> float:
    session = xrt.InferenceSession(MODEL, engine="onnxrt", policy=POLICY)
    started = time.perf_counter()
    for i in range(0, len(images), batch):
        session.run({"image": images[i : i + batch]})
    return len(images) / (time.perf_counter() - started)


def ray_data(images: np.ndarray, batch: int, actors: int) -> float:
    dataset = (
        ray.data.from_numpy(images)
        .repartition(8)
        .map_batches(
            Predictor,
            fn_constructor_kwargs={
                "model": MODEL,
                "engine": "onnxrt",
                "policy": POLICY,
                "columns": {"image": "data"},
            },
            concurrency=actors,
            num_cpus=0.5,  # leaves CPU for the read and repartition tasks on 2 CPUs
            batch_size=batch,
            batch_format="numpy",
        )
    )
    dataset.materialize()  # warm: actors built, sessions loaded
    started = time.perf_counter()
    rows = sum(len(b["probabilities"]) for b in dataset.iter_batches(batch_size=None))
    return rows / (time.perf_counter() - started)


async def serve_load(handle, requests: int, concurrency: int) -> list[float]:
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), np.float32)
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)  # at most this many requests in flight

    async def one() -> None:
        async with gate:
            started = time.perf_counter()
            await handle.predict.remote({"image": x})
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(one() for _ in range(requests)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    cpus = os.cpu_count() or 2
    images = np.random.default_rng(1).standard_normal((args.rows, 3, 32, 32)).astype(np.float32)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    anchor = plain_loop(images, args.batch)
    print(f"# {platform.processor() or platform.machine()}, {cpus} CPUs, ray {ray.__version__}")
    print(f"| batch inference, {args.rows} rows, batch {args.batch} | rows/s | vs plain loop |")
    print("| --- | --- | --- |")
    print(f"| plain loop over one session | {anchor:.0f} | 1.00 |")
    for actors in (1, 2):
        rate = ray_data(images, args.batch, actors)
        print(f"| Ray Data, {actors} actor(s) | {rate:.0f} | {rate / anchor:.2f} |")
    handle = serve.run(
        deployment(
            MODEL,
            engine="onnxrt",
            policy=POLICY,
            num_replicas=2,
            num_cpus=0.5,
            max_batch_size=16,
            batch_wait_timeout_s=0.002,
        ),
        name="bench",
        route_prefix="/bench",
    )
    asyncio.run(serve_load(handle, 50, args.concurrency))  # warm-up
    started = time.perf_counter()
    latencies = sorted(asyncio.run(serve_load(handle, args.requests, args.concurrency)))
    elapsed = time.perf_counter() - started
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[int(0.99 * (len(latencies) - 1))] * 1e3
    print(
        f"\nRay Serve, 2 replicas, {args.requests} requests of 1 image, at most "
        f"{args.concurrency} in flight (handle API): p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
        f"{args.requests / elapsed:.0f} requests/s"
    )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

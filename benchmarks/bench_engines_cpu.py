"""Real models on the CPU: ONNX Runtime vs OpenVINO, fp32 and each engine's default
precision, with accuracy against ONNX Runtime fp32, and what engine="auto" with
best_performance picks, all in one run.

    python benchmarks/bench_engines_cpu.py [--seconds 2]
"""

import argparse
import importlib.util
import platform
import tempfile
from pathlib import Path

import numpy as np

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path
from xpuruntime.inference import measure_latency


def real_models() -> list[tuple[str, Path, dict]]:
    rng = np.random.default_rng(0)
    models = [("demo CNN b8", demo_model_path(),
               {"image": rng.standard_normal((8, 3, 32, 32), np.float32)})]
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec:
        root = Path(spec.origin).parent / "models"
        models.append(("PP-OCRv4 det 1x3x640x640", root / "ch_PP-OCRv4_det_infer.onnx",
                       {"x": rng.uniform(-1, 1, (1, 3, 640, 640)).astype(np.float32)}))
        models.append(("PP-OCRv4 rec 8x3x48x320", root / "ch_PP-OCRv4_rec_infer.onnx",
                       {"x": rng.uniform(-1, 1, (8, 3, 48, 320)).astype(np.float32)}))
    spec = importlib.util.find_spec("magika")
    if spec:
        path = Path(spec.origin).parent / "models" / "standard_v3_3" / "model.onnx"
        session = xrt.InferenceSession(path)
        (inp,) = session.inputs
        models.append(("Magika b16", path, {inp.name: rng.integers(
            0, 257, (16, *inp.shape[1:])).astype(inp.dtype)}))
    return models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    cpu = xrt.Device("cpu").info
    print(f"# {cpu.name}, {cpu.details['cores']} cores; bf16 native: {cpu.supports_bf16}")
    print("| model | engine | precision | p50 ms | vs fastest | rel L2 vs ORT fp32 | gate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, path, feeds in real_models():
        reference = xrt.InferenceSession(path, engine="onnxrt").run(feeds)
        rows = []
        for engine in ("onnxrt", "openvino"):
            for precision in ("fp32", "default"):
                if engine == "onnxrt" and precision == "default":
                    continue  # ONNX Runtime's default precision is the model's: fp32
                session = xrt.InferenceSession(
                    path, engine=engine, policy={"precision": precision, "strict": True})
                stats = measure_latency(lambda s=session: s.run(feeds), min_seconds=args.seconds)
                outs = session.run(feeds)
                rel = max(np.linalg.norm(o.astype(np.float64) - r) / np.linalg.norm(r)
                          for o, r in zip(outs, reference))
                rows.append((engine, precision, stats.p50, rel))
        with tempfile.TemporaryDirectory() as cache:
            auto = xrt.InferenceSession(path, sample_inputs=feeds, policy={
                "auto_strategy": "best_performance", "cache_dir": cache,
                "accuracy": {"rtol": 1e-3, "atol": 1e-4}})
            auto_p50 = measure_latency(lambda: auto.run(feeds), min_seconds=args.seconds).p50
        fastest = min(p for e, prec, p, rel in rows if prec == "fp32")
        for engine, precision, p50, rel in rows:
            print(f"| {label} | {engine} | {precision} | {p50 * 1e3:.3f} | "
                  f"{p50 / fastest:.2f} | {rel:.1e} | |")
        print(f"| {label} | auto -> {auto.engine} | fp32 | {auto_p50 * 1e3:.3f} | "
              f"{auto_p50 / fastest:.2f} | | gate rtol 1e-3 |")


if __name__ == "__main__":
    print(f"# python {platform.python_version()}")
    main()

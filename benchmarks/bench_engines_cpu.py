"""Real models on the CPU: ONNX Runtime vs OpenVINO, fp32 and each engine's default
precision, with accuracy against ONNX Runtime fp32, and what engine="auto" with
best_performance picks, all in one run. With onnxruntime-qnn installed, a QNN row: its
HTP backend in Qualcomm's emulation on the host CPU, with the nodes QNN took (emulation
speed says nothing about a Snapdragon NPU's).

    python benchmarks/bench_engines_cpu.py [--seconds 2]
"""

import argparse
import importlib.util
import platform
import tempfile
import warnings
from pathlib import Path

import numpy as np

import xpuruntime as xrt
from xpuruntime.cli import demo_model_path
from xpuruntime.inference import measure_latency


def real_models() -> list[tuple[str, Path, dict]]:
    rng = np.random.default_rng(0)
    models = [
        (
            "demo CNN b8",
            demo_model_path(),
            {"image": rng.standard_normal((8, 3, 32, 32), np.float32)},
        )
    ]
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec:
        root = Path(spec.origin).parent / "models"
        models.append(
            (
                "PP-OCRv4 det 1x3x640x640",
                root / "ch_PP-OCRv4_det_infer.onnx",
                {"x": rng.uniform(-1, 1, (1, 3, 640, 640)).astype(np.float32)},
            )
        )
        models.append(
            (
                "PP-OCRv4 rec 8x3x48x320",
                root / "ch_PP-OCRv4_rec_infer.onnx",
                {"x": rng.uniform(-1, 1, (8, 3, 48, 320)).astype(np.float32)},
            )
        )
    spec = importlib.util.find_spec("magika")
    if spec:
        path = Path(spec.origin).parent / "models" / "standard_v3_3" / "model.onnx"
        session = xrt.InferenceSession(path)
        (inp,) = session.inputs
        models.append(
            (
                "Magika b16",
                path,
                {inp.name: rng.integers(0, 257, (16, *inp.shape[1:])).astype(inp.dtype)},
            )
        )
    return models


def interleaved_p50(fns: dict, seconds: float, rounds: int = 10) -> dict:
    """p50 per callable, timed in ``rounds`` interleaved windows so drift hits all alike."""
    samples = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            samples[key] += measure_latency(
                fn, warmup=1, min_iterations=3, min_seconds=seconds / rounds
            ).samples
    return {key: float(np.median(s)) for key, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="timing budget per configuration and model"
    )
    args = parser.parse_args()
    cpu = xrt.Device("cpu").info
    print(f"# {cpu.name}, {cpu.details['cores']} cores; bf16 native: {cpu.supports_bf16}")
    print("| model | engine | precision | p50 ms | vs fastest fp32 | rel L2 vs ORT fp32 | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, path, feeds in real_models():
        reference = xrt.InferenceSession(path, engine="onnxrt").run(feeds)
        sessions = {}
        for engine in ("onnxrt", "openvino"):
            for precision in ("fp32", "default"):
                if engine == "onnxrt" and precision == "default":
                    continue  # ONNX Runtime's default precision is the model's: fp32
                sessions[(engine, precision)] = xrt.InferenceSession(
                    path, engine=engine, policy={"precision": precision, "strict": True}
                )
        with tempfile.TemporaryDirectory() as cache:
            auto = xrt.InferenceSession(
                path,
                sample_inputs=feeds,
                policy={
                    "auto_strategy": "best_performance",
                    "cache_dir": cache,
                    "accuracy": {"rtol": 1e-3, "atol": 1e-4},
                },
            )
        sessions[(f"auto -> {auto.engine}", "fp32")] = auto
        notes = {}
        if importlib.util.find_spec("onnxruntime_qnn") is not None:
            try:  # not strict: nodes QNN lacks run on the CPU EP, and the note counts them
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", xrt.FallbackWarning)
                    qnn = xrt.InferenceSession(
                        path, engine="qnn", device="npu", sample_inputs=feeds
                    )
                placement = qnn._engine.placement
                sessions[("qnn (HTP emulation)", "fp32")] = qnn
                notes[("qnn (HTP emulation)", "fp32")] = (
                    f"{placement.on_target} of {len(placement.nodes)} nodes on QNN"
                )
            except xrt.XpuRuntimeError as e:
                print(f"| {label} | qnn | fp32 | | | | {type(e).__name__}: {str(e)[:120]} |")
        p50 = interleaved_p50(
            {key: (lambda s=s, f=feeds: s.run(f)) for key, s in sessions.items()}, args.seconds
        )
        fastest = min(
            t
            for (engine, precision), t in p50.items()
            if precision == "fp32" and not engine.startswith("auto")
        )
        for (engine, precision), session in sessions.items():
            rel = max(
                np.linalg.norm(o.astype(np.float64) - r) / np.linalg.norm(r)
                for o, r in zip(session.run(feeds), reference)
            )
            t = p50[(engine, precision)]
            print(
                f"| {label} | {engine} | {precision} | {t * 1e3:.3f} | {t / fastest:.2f} | "
                f"{rel:.1e} | {notes.get((engine, precision), '')} |"
            )
        print(f"<!-- {label}: auto measured {auto.decision.measurements} -->")


if __name__ == "__main__":
    print(f"# python {platform.python_version()}")
    main()

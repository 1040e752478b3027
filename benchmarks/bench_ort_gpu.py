"""ONNX Runtime's CUDA EP at batch 1: raw run() with numpy feeds vs xpuruntime sessions
with IO binding and CUDA graphs, and xpuruntime's overhead over raw ONNX Runtime doing
the same binding, in one run (GPU; needs onnxruntime-gpu).

Models: PP-OCRv4 detection (a real conv net, 1x3x640x640) and recognition (SVTR, a
conv stem with transformer blocks, 1x3x48x320), from the rapidocr_onnxruntime wheel or
$XRT_MODEL_DIR, plus a 4-layer BERT-base-sized encoder (seq 128) exported from PyTorch
when torch is present. Each model twice: in fp32 with TF32 off on both sides, and with
ONNX Runtime's default CUDA EP options on the raw side and ``precision="default"`` on
ours (TF32 as ONNX Runtime does by default; the row says which).

Columns (p50 wall-clock per call, host in and host out unless "dev"):
  ort numpy     raw InferenceSession.run with numpy feeds (the anchor)
  ort graph     raw ORT: enable_cuda_graph, static OrtValues, update_inplace, .numpy()
  xrt graph     xrt.InferenceSession(policy={"cuda_graph": True}).run(numpy)
  ort graph dev raw ORT graph, input copied from a torch CUDA tensor, output left on device
  xrt graph dev xrt session, torch CUDA input, output_device="cuda"
Goals: ort numpy / xrt graph >= 1.5; xrt graph / ort graph <= 1.03 (both host and dev).
The speedups are ratios of p50s over all calls; the overhead ratios are the median over
rounds of each round's p50 ratio (the two sides run back to back in every round, so
drift of the host between rounds cancels).

    python benchmarks/bench_ort_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import xpuruntime as xrt

ROUNDS, CALLS, WARMUP = 15, 40, 20


def model_path(name: str) -> Path:
    brought = Path(os.environ.get("XRT_MODEL_DIR", "/nonexistent")) / name
    if brought.exists():
        return brought
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    return Path(spec.origin).parent / "models" / name


def page_like(shape: list[int]) -> np.ndarray:
    """Dark word strokes on paper, normalised as PP-OCR does (noise gives all-zero maps)."""
    _, channels, height, width = shape
    rng = np.random.default_rng(0)
    page = np.full((height, width), 235.0) + rng.normal(0, 4, (height, width))
    for _ in range(max(1, height * width // 10000)):
        row = rng.integers(0, max(1, height - 24))
        col = rng.integers(0, max(1, width - 140))
        stroke = rng.integers(8, min(24, height // 2) + 1)
        for k in range(rng.integers(3, 12)):
            w = rng.integers(4, stroke + 1)
            page[row : row + stroke, col + k * (w + 3) : col + k * (w + 3) + w] = 40
    x = (np.clip(page, 0, 255) / 255.0 - 0.5) / 0.5
    return np.repeat(x[None, None], channels, axis=1)


def bert_encoder(folder: Path) -> Path:
    import torch

    layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
    path = folder / "bert4.onnx"
    x = torch.randn(1, 128, 768)
    torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    return path


def raw_session(path: Path, graph: bool, tf32_off: bool) -> ort.InferenceSession:
    options = {"device_id": 0}
    if tf32_off:
        options["use_tf32"] = 0
    if graph:
        options["enable_cuda_graph"] = "1"
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(str(path), so, providers=[("CUDAExecutionProvider", options)])


def interleaved(fns: dict) -> tuple[dict[str, float], dict[str, list[float]]]:
    """p50 ms per call of each fn over all rounds, and each fn's p50 in every round;
    rounds are interleaved so drift hits all alike."""
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    samples = {k: [] for k in fns}
    rounds = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            this_round = []
            for _ in range(CALLS):
                t = time.perf_counter()
                fn()
                this_round.append(time.perf_counter() - t)
            samples[name] += this_round
            rounds[name].append(statistics.median(this_round))
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}, rounds


def paired(rounds: dict[str, list[float]], ours: str, theirs: str) -> float:
    """The median over rounds of ``ours`` / ``theirs`` p50 in the same round."""
    return statistics.median(a / b for a, b in zip(rounds[ours], rounds[theirs]))


def bench(label: str, path: Path, shape: list[int], tf32_off: bool) -> dict[str, float]:
    import torch

    plain = raw_session(path, False, tf32_off)
    meta = plain.get_inputs()[0]
    tf32 = plain.get_provider_options()["CUDAExecutionProvider"].get("use_tf32")
    label += ", fp32 TF32 off" if tf32_off else f", ORT defaults (use_tf32={tf32})"
    x = page_like(shape) if len(shape) == 4 else np.random.default_rng(0).standard_normal(shape)
    x = x.astype(np.float32)
    x_dev = torch.from_numpy(x).cuda()

    name = meta.name

    graphed = raw_session(path, True, tf32_off)
    static_in = torch.empty_like(x_dev)
    static_out_holder = {}
    binding = graphed.io_binding()
    binding.bind_input(name, "cuda", 0, np.float32, list(x.shape), static_in.data_ptr())
    for out in graphed.get_outputs():
        binding.bind_output(out.name, "cuda", 0)
    static_in.copy_(x_dev)
    torch.cuda.synchronize()
    graphed.run_with_iobinding(binding)
    outs = binding.get_outputs()
    for out, value in zip(graphed.get_outputs(), outs):
        binding.bind_ortvalue_output(out.name, value)
    static_out_holder["outs"] = outs

    def raw_graph_host():
        static_in.copy_(torch.from_numpy(x), non_blocking=False)
        graphed.run_with_iobinding(binding)
        return [o.numpy() for o in static_out_holder["outs"]]

    def raw_graph_dev():
        static_in.copy_(x_dev)
        graphed.run_with_iobinding(binding)
        return static_out_holder["outs"]

    policy = {"cuda_graph": True, "precision": "fp32" if tf32_off else "default"}
    session = xrt.InferenceSession(
        path, device="cuda", engine="onnxrt", policy=policy, sample_inputs=[x]
    )

    reference = plain.run(None, {name: x})[0]
    check = session.run([x])[0]
    rel = float(np.linalg.norm(check - reference) / np.linalg.norm(reference))
    times, rounds = interleaved(
        {
            "ort numpy": lambda: plain.run(None, {name: x}),
            "ort graph": raw_graph_host,
            "xrt graph": lambda: session.run([x]),
            "ort graph dev": raw_graph_dev,
            "xrt graph dev": lambda: session.run([x_dev], output_device="cuda"),
        }
    )
    times["rel_err"] = rel
    host, dev = (
        paired(rounds, "xrt graph", "ort graph"),
        paired(rounds, "xrt graph dev", "ort graph dev"),
    )
    print(
        f"| {label} | {times['ort numpy']:.3f} | {times['ort graph']:.3f} | "
        f"{times['xrt graph']:.3f} | {times['ort graph dev']:.3f} | {times['xrt graph dev']:.3f} | "
        f"{times['ort numpy'] / times['xrt graph']:.2f}x / {times['ort numpy'] / times['xrt graph dev']:.2f}x | "
        f"{host:.3f} / {dev:.3f} | "
        f"{rel:.1e} |",
        flush=True,
    )
    return times


def main() -> None:
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    import torch

    print(
        f"onnxruntime {ort.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}"
    )
    print(
        f"p50 ms per call, {ROUNDS}x{CALLS} interleaved calls each, batch 1; overhead: "
        "median of the rounds' paired ratios"
    )
    print(
        "| model | ort numpy | ort graph | xrt graph | ort graph dev | xrt graph dev | "
        "speedup vs numpy (host / dev) | xrt / ort same binding (host / dev) | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    models = [
        (
            "PP-OCRv4 det 1x3x640x640 (conv)",
            model_path("ch_PP-OCRv4_det_infer.onnx"),
            [1, 3, 640, 640],
        ),
        (
            "PP-OCRv4 rec 1x3x48x320 (SVTR)",
            model_path("ch_PP-OCRv4_rec_infer.onnx"),
            [1, 3, 48, 320],
        ),
    ]
    with tempfile.TemporaryDirectory() as folder:
        try:
            models.append(
                ("BERT-base encoder, 4 layers, seq 128", bert_encoder(Path(folder)), [1, 128, 768])
            )
        except Exception as e:  # the exporter is optional here; say so and go on
            print(f"(transformer export skipped: {type(e).__name__}: {e})")
        for label, path, shape in models:
            for tf32_off in (True, False):
                try:
                    bench(label, path, shape, tf32_off)
                except Exception as e:
                    print(f"| {label} | failed: {type(e).__name__}: {str(e)[:300]} |")


if __name__ == "__main__":
    main()

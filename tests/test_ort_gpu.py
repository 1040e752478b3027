"""ONNX Runtime on the CUDA EP through InferenceSession: accuracy, zero-copy device I/O,
CUDA-graph mode, fp16, kernel-policy options, and TensorRT's absence."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import xpuruntime as xrt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _cuda_ep():
    ort = pytest.importorskip("onnxruntime")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu (CUDAExecutionProvider) is not installed")


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _det_input(seed=0):
    """A page-like image (dark word strokes on paper), normalised as PP-OCR does, so that
    the detector's probability map is not all zeros."""
    rng = np.random.default_rng(seed)
    page = np.full((640, 640), 235.0) + rng.normal(0, 4, (640, 640))
    for _ in range(40):
        row, col, height = rng.integers(0, 600), rng.integers(0, 500), rng.integers(8, 24)
        for k in range(rng.integers(3, 12)):
            width = rng.integers(4, height)
            page[row : row + height, col + k * (width + 3) : col + k * (width + 3) + width] = 40
    x = (np.clip(page, 0, 255) / 255.0 - 0.5) / 0.5
    return np.repeat(x[None, None], 3, axis=1).astype(np.float32)


def test_a_real_conv_model_on_the_cuda_ep_matches_ort_cpu_fp32(ppocr_det_model):
    x = _det_input()
    reference = xrt.InferenceSession(ppocr_det_model, engine="onnxrt").run([x])[0]
    session = xrt.InferenceSession(
        ppocr_det_model, device="cuda", engine="onnxrt", policy={"strict": True}
    )
    assert session.engine_settings["providers"][0] == "CUDAExecutionProvider"
    assert session.engine_settings["cpu_fallback"] == "disabled"
    assert session.engine_settings["tf32"] is False
    assert _rel(session.run([x])[0], reference) < 1e-4


def test_torch_inputs_are_bound_without_a_host_copy_and_outputs_stay_on_the_device(
    ppocr_det_model,
):
    torch = pytest.importorskip("torch")
    from xpuruntime import pytorch as xpt

    x = _det_input(1)
    session = xrt.InferenceSession(ppocr_det_model, device="cuda", engine="onnxrt")
    expected = session.run([x])[0]
    device_x = torch.from_numpy(x).cuda()
    torch.cuda.synchronize()
    with xpt.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        (out,) = session.run([device_x], output_device="cuda")
        result = torch.from_dlpack(out)
    copies = [e.name for e in prof.events() if "memcpy" in e.name.lower()]
    assert not any("htod" in c.lower() for c in copies), copies
    assert result.is_cuda and _rel(result.cpu().numpy(), expected) < 1e-5
    with xpt.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        session.run([x])
    assert any("htod" in e.name.lower() for e in prof.events())  # the numpy path does copy


def test_a_device_tensor_of_the_wrong_dtype_is_named(mlp_model):
    torch = pytest.importorskip("torch")
    session = xrt.InferenceSession(mlp_model, device="cuda", engine="onnxrt")
    with pytest.raises(xrt.InvalidInputError, match="expected dtype float32, got float64"):
        session.run({"x": torch.ones(2, 16, dtype=torch.float64, device="cuda")})


def test_cuda_graph_mode_replays_with_the_same_outputs(ppocr_det_model):
    torch = pytest.importorskip("torch")
    plain = xrt.InferenceSession(ppocr_det_model, device="cuda", engine="onnxrt")
    graphed = xrt.InferenceSession(
        ppocr_det_model,
        device="cuda",
        engine="onnxrt",
        policy={"cuda_graph": True},
        sample_inputs=[_det_input()],
    )
    assert graphed.engine_settings["cuda_graph"].startswith("captured")
    for seed in range(3):
        x = _det_input(seed)
        expected = plain.run([x])[0]
        assert _rel(graphed.run([x])[0], expected) < 1e-5
        (out,) = graphed.run([torch.from_numpy(x).cuda()], output_device="cuda")
        assert _rel(torch.from_dlpack(out).cpu().numpy(), expected) < 1e-5
    with pytest.raises(xrt.InvalidInputError, match="differs from the captured"):
        graphed.run([np.zeros((1, 3, 320, 320), np.float32)])


@pytest.mark.parametrize("graph", [False, True], ids=["plain", "cuda_graph"])
@pytest.mark.parametrize("producer", ["default stream", "side stream"])
def test_a_device_input_still_being_written_is_waited_for(mlp_model, graph, producer):
    # The input is written after a long kernel on the producer's stream; the session must
    # read the final values (no host synchronisation in between).
    torch = pytest.importorskip("torch")
    values = torch.linspace(-2, 2, 4 * 16, device="cuda").reshape(4, 16)
    host = values.cpu().numpy()
    policy = {"cuda_graph": True} if graph else {}
    session = xrt.InferenceSession(
        mlp_model, device="cuda", engine="onnxrt", policy=policy, sample_inputs=[host]
    )
    expected = session.run([host])[0]
    side = torch.cuda.Stream() if producer == "side stream" else torch.cuda.current_stream()
    for _ in range(3):
        x = torch.zeros(4, 16, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # some milliseconds
            x.copy_(values)
            (out,) = session.run([x], output_device="cuda")
            result = torch.from_dlpack(out).cpu().numpy()
        assert _rel(result, expected) < 1e-6


def test_cuda_graph_mode_refuses_overlapping_runs(mlp_model):
    session = xrt.InferenceSession(
        mlp_model,
        device="cuda",
        engine="onnxrt",
        policy={"cuda_graph": True},
        sample_inputs={"x": np.ones((4, 16), np.float32)},
    )
    runner = session._engine._graph
    entered = threading.Event()
    with runner._busy:  # another thread is mid-run
        entered.set()
        with pytest.raises(xrt.UnsupportedOperationError, match="another thread"):
            session.run({"x": np.ones((4, 16), np.float32)})


def test_cuda_graph_mode_needs_fixed_shapes_up_front(mlp_model):
    with pytest.raises(xrt.UnsupportedOperationError, match="fixed input shapes"):
        xrt.InferenceSession(
            mlp_model, device="cuda", engine="onnxrt", policy={"cuda_graph": True, "strict": True}
        )


def test_fp16_precision_runs_a_converted_model_within_tolerance(ppocr_rec_model):
    # The recogniser (SVTR) survives a blanket float16 conversion; the detector does not
    # (4% of its pixels flip), which is what the accuracy gate is for.
    page = np.full((48, 320), 235.0)
    for k in range(20):
        page[12:36, 8 + k * 15 : 8 + k * 15 + 4 + k % 8] = 30
    x = np.repeat(((page / 255 - 0.5) / 0.5)[None, None], 3, 1).astype(np.float32)
    reference = xrt.InferenceSession(ppocr_rec_model, engine="onnxrt").run([x])[0]
    session = xrt.InferenceSession(
        ppocr_rec_model, device="cuda", engine="onnxrt", policy={"precision": "fp16"}
    )
    out = session.run([x])[0]
    assert _rel(out, reference) < 2e-2
    assert (out.argmax(-1) == reference.argmax(-1)).all()


def test_kernel_policy_keys_are_reported_as_honoured_or_ignored(mlp_model):
    session = xrt.InferenceSession(
        mlp_model,
        device="cuda",
        engine="onnxrt",
        policy={"kernels": {"conv": "cudnn_benchmark", "matmul": "cublasLt", "attention": "cudnn"}},
    )
    text = session.explain()
    assert "conv=cudnn_benchmark: honoured (cudnn_conv_algo_search=EXHAUSTIVE)" in text
    assert "matmul=cublasLt: ignored" in text
    assert "attention=cudnn: honoured (sdpa_kernel=8" in text


def test_tensorrt_says_which_library_is_missing(mlp_model):
    with pytest.raises(xrt.BackendUnavailableError, match="libnvinfer"):
        xrt.InferenceSession(mlp_model, device="cuda", engine="tensorrt", policy={"strict": True})

"""Shared fixtures: models built with onnx.helper, real models from installed wheels."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def _cuda_devices() -> int:
    try:
        import xpuruntime as xrt

        return xrt.get_device_count("cuda")
    except Exception:
        return 0


# Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen
# before any kernel is defined (before xpuruntime.pytorch is imported). With a GPU the
# same tests run the compiled kernels.
if not _cuda_devices():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    devices = _cuda_devices()
    gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    gpus2 = pytest.mark.skip(reason=f"needs two CUDA GPUs (this machine has {devices})")
    for item in items:
        if "gpu" in item.keywords and devices == 0:
            item.add_marker(gpu)
        elif "gpus2" in item.keywords and devices < 2:
            item.add_marker(gpus2)


@pytest.fixture
def clean_kernel_policy():
    """Leave no kernel policy or dispatch log behind (they are process-global)."""
    yield
    from xpuruntime import pytorch as xpt

    xpt.disable_dispatch_logging()
    xpt.clear_dispatch_logs()
    xpt.clear_kernel_policy()


@pytest.fixture
def fp8_here(monkeypatch):
    """Without a CUDA GPU, the FP8 device check set aside: PyTorch's ``_scaled_mm`` and
    Triton's interpreter run FP8 on the CPU."""
    if not _cuda_devices():
        from xpuruntime.pytorch._kernels import fp8 as fp8_kernels

        monkeypatch.setattr(fp8_kernels, "fp8_refusal", lambda device: None)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory, and sees its own fallback warnings."""
    monkeypatch.setenv("XPURUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    from xpuruntime.kernels import dispatcher

    dispatcher.forget_warnings()


def make_model(nodes, inputs, outputs, initializers=(), name="test") -> bytes:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    # IR 10 / opset 17: what ONNX Runtime and OpenVINO both load.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.fixture(scope="session")
def mlp_model() -> bytes:
    """x[batch, 16] -> Gemm(32) -> Relu -> Gemm(8) -> y[batch, 8]."""
    rng = np.random.default_rng(1)
    weights = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32) * 0.3, "w2"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["y"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        weights,
        name="mlp",
    )


@pytest.fixture(scope="session")
def two_input_model() -> bytes:
    """a[batch, 4] float32 and ids[batch, 3] int64 -> out[batch, 4] = a * (sum of all ids)."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["idsf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["idsf"], ["s"], keepdims=1),
        helper.make_node("Mul", ["a", "s"], ["out"]),
    ]
    return make_model(
        nodes,
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
        name="two_inputs",
    )


@pytest.fixture(scope="session")
def conv_model() -> bytes:
    from xpuruntime.cli import demo_model_path

    return demo_model_path().read_bytes()


def _wheel_file(package: str, *parts: str) -> Path:
    # The GPU machine cannot install the wheels; scripts/gpu-check brings their models
    # and names the folder in XRT_MODEL_DIR.
    brought = Path(os.environ.get("XRT_MODEL_DIR", "/nonexistent")) / parts[-1]
    if brought.exists():
        return brought
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed (it is a dev dependency)")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} missing from the installed {package} wheel")
    return path


@pytest.fixture(scope="session")
def ppocr_det_model() -> Path:
    """PP-OCRv4 text detection (a real conv net), from the rapidocr_onnxruntime wheel."""
    return _wheel_file("rapidocr_onnxruntime", "models", "ch_PP-OCRv4_det_infer.onnx")


@pytest.fixture(scope="session")
def ppocr_rec_model() -> Path:
    """PP-OCRv4 text recognition (SVTR: convs and attention), same wheel."""
    return _wheel_file("rapidocr_onnxruntime", "models", "ch_PP-OCRv4_rec_infer.onnx")


@pytest.fixture(scope="session")
def magika_model() -> Path:
    """Google's Magika file-type classifier, from the magika wheel."""
    return _wheel_file("magika", "models", "standard_v3_3", "model.onnx")


@pytest.fixture(scope="session")
def ppocr_cls_model() -> Path:
    """PP-OCR text-direction classifier (a small conv net with MaxPool), same wheel."""
    return _wheel_file("rapidocr_onnxruntime", "models", "ch_ppocr_mobile_v2.0_cls_infer.onnx")


@pytest.fixture(scope="session")
def silero_vad_model() -> Path:
    """Silero VAD in the form it ships for OpenVINO: one 36 ms chunk (input [1, 576]) and
    its LSTM state ([2, 1, 128], batch on axis 1), from the silero-vad wheel."""
    return _wheel_file("silero_vad", "data", "silero_vad_openvino_16k.onnx")

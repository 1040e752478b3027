"""Inputs keep their meaning: rank-0 inputs stay rank 0, types numpy cannot carry reach
the backend as the declared ONNX type and come back labelled as declared, and arguments
of the wrong kind are refused by name."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import make_model
from onnx import TensorProto, helper

import xpuruntime as xrt

ENGINES = ["onnxrt", "openvino"]


def _model(nodes, inputs, outputs, opset=21):
    graph = helper.make_graph(nodes, "t", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return model.SerializeToString()


@pytest.fixture(scope="module")
def scalar_model() -> bytes:
    """s: float32 scalar, v: float32[3], n: int64 scalar -> (s * v, n + 1, s)."""
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    return make_model(
        [
            helper.make_node("Mul", ["s", "v"], ["scaled"]),
            helper.make_node("Constant", [], ["c1"], value=one),
            helper.make_node("Add", ["n", "c1"], ["next"]),
            helper.make_node("Identity", ["s"], ["same"]),
        ],
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("next", TensorProto.INT64, []),
            helper.make_tensor_value_info("same", TensorProto.FLOAT, []),
        ],
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "convert", ["none", "widen_scalar", "widen_other", "non_contiguous", "big_endian"]
)
def test_rank0_inputs_stay_rank0_on_every_path(scalar_model, engine, convert):
    pytest.importorskip({"onnxrt": "onnxruntime", "openvino": "openvino"}[engine])
    s, v, n = np.array(2.0, np.float32), np.arange(3, dtype=np.float32), np.array(5)
    if convert == "widen_scalar":
        s = s.astype(np.float16)
    elif convert == "widen_other":
        n = n.astype(np.int32)
    elif convert == "non_contiguous":
        v = np.arange(6, dtype=np.float32)[::2]
    elif convert == "big_endian":
        v = v.astype(">f4")
    session = xrt.InferenceSession(scalar_model, engine=engine, policy={"strict": True})
    scaled, nxt, same = session.run({"s": s, "v": v, "n": n})
    assert (scaled.shape, nxt.shape, same.shape) == ((3,), (), ())
    np.testing.assert_array_equal(scaled, 2.0 * np.asarray(v, np.float32))
    assert int(nxt) == 6 and float(same) == 2.0


EXOTIC = {
    "bfloat16": TensorProto.BFLOAT16,
    "float8_e4m3fn": TensorProto.FLOAT8E4M3FN,
    "float8_e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ,
    "float8_e5m2": TensorProto.FLOAT8E5M2,
    "float8_e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ,
    "int4": TensorProto.INT4,
    "uint4": TensorProto.UINT4,
    "float4_e2m1fn": TensorProto.FLOAT4E2M1,
}


def _round_trip_model(onnx_type: int) -> bytes:
    """x: T[2, 3] -> (Cast to float32, Cast back to T): reads and writes T."""
    return _model(
        [
            helper.make_node("Cast", ["x"], ["as_float"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["as_float"], ["back"], to=onnx_type),
        ],
        [helper.make_tensor_value_info("x", onnx_type, [2, 3])],
        [
            helper.make_tensor_value_info("as_float", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("back", onnx_type, [2, 3]),
        ],
    )


def _raw_runs(engine: str, model: bytes, onnx_type: int, x: np.ndarray) -> bool:
    """Whether the raw backend itself runs the model on ``x`` (by its own typed API)."""
    try:
        if engine == "onnxrt":
            import ctypes

            import onnxruntime as ort

            from xpuruntime.engines._dtypes import exotic_type, to_raw

            session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), onnx_type)
            raw = to_raw(x, exotic_type(x.dtype))
            ctypes.memmove(value.data_ptr(), raw.ctypes.data, raw.nbytes)
            session.run_with_ort_values(["as_float", "back"], {"x": value})
        else:
            import openvino as ov

            core = ov.Core()
            core.compile_model(core.read_model(model, b""), "CPU")
    except Exception:
        return False
    return True


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(EXOTIC))
def test_types_numpy_cannot_carry_run_and_come_back_labelled(engine, name):
    pytest.importorskip({"onnxrt": "onnxruntime", "openvino": "openvino"}[engine])
    dtype = np.dtype(getattr(ml_dtypes, name))
    values = [-1.5, 0.5, 2.0, 3.0, 0.0, 1.0] if "int" not in name else [-3, 1, 2, 5, 0, 7]
    if name == "uint4":
        values = [3, 1, 2, 5, 0, 15]
    x = np.array(values, np.float32).reshape(2, 3).astype(dtype)
    model = _round_trip_model(EXOTIC[name])
    if not _raw_runs(engine, model, EXOTIC[name], x):
        pytest.skip(f"raw {engine} cannot run {name} either")
    session = xrt.InferenceSession(model, engine=engine, policy={"strict": True})
    as_float, back = session.run({"x": x})
    assert back.dtype == dtype and back.shape == (2, 3)
    np.testing.assert_array_equal(as_float, x.astype(np.float32))
    np.testing.assert_array_equal(back.astype(np.float32), x.astype(np.float32))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bfloat16_torch_tensor_is_read_through_dlpack(engine):
    torch = pytest.importorskip("torch")
    pytest.importorskip({"onnxrt": "onnxruntime", "openvino": "openvino"}[engine])
    session = xrt.InferenceSession(
        _round_trip_model(TensorProto.BFLOAT16), engine=engine, policy={"strict": True}
    )
    x = torch.tensor([[1.5, -2.0, 3.25], [0.0, 8.0, -0.5]], dtype=torch.bfloat16)
    as_float, back = session.run([x])
    np.testing.assert_array_equal(as_float, x.float().numpy())
    assert back.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(back.astype(np.float32), x.float().numpy())


def test_arguments_of_the_wrong_kind_are_refused_by_name(mlp_model):
    session = xrt.InferenceSession(mlp_model, engine="onnxrt")
    x = np.ones((2, 16), np.float32)
    with pytest.raises(xrt.InvalidInputError, match="masked"):
        session.run({"x": np.ma.masked_array(x, mask=np.zeros_like(x, bool))})
    for bad in (123, "y", {"y": 1}):
        with pytest.raises(xrt.InvalidInputError, match="output_names"):
            session.run({"x": x}, output_names=bad)
    with pytest.raises(xrt.InvalidInputError, match="empty"):
        session.run({"x": x}, output_names=[])
    with pytest.raises(xrt.InvalidInputError, match="unknown output"):
        session.run({"x": x}, output_names=[3])

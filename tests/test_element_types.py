"""Every ONNX element type either crosses to the backends as its declared type or is
named as one no backend here runs: the next onnx release's new type fails here loudly
instead of failing users silently."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import xpuruntime as xrt
from xpuruntime.engines._dtypes import TYPES, exotic_type, from_raw, to_raw

# Types no backend installed here runs, and why (checked below against ONNX Runtime).
_NOT_RUN = {
    "UNDEFINED": "not an element type",
    "FLOAT6E2M3": "onnxruntime 1.32: 'tensor type 27 is not supported'",
    "FLOAT6E3M2": "onnxruntime 1.32: 'tensor type 28 is not supported'",
}


def _ort_takes(number: int) -> bool:
    import onnxruntime as ort

    try:
        ort.OrtValue.ortvalue_from_shape_and_type([3], number)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("name", sorted(TensorProto.DataType.keys()))
def test_every_onnx_element_type_crosses_as_itself_or_is_named_as_not_run(name):
    number = TensorProto.DataType.Value(name)
    if name in _NOT_RUN:
        assert not _ort_takes(number), f"onnxruntime now runs {name}: add it to _dtypes.TYPES"
        return
    dtype = helper.tensor_dtype_to_np_dtype(number)
    rule = exotic_type(dtype)
    if dtype.type.__module__ == "numpy":  # numpy carries it; the backends take it as is
        assert rule is None
        return
    assert rule is not None, f"{name} ({dtype}) has no crossing rule in _dtypes.TYPES"
    assert rule.onnx_type == number
    assert _ort_takes(number)


@pytest.mark.parametrize("dtype_name", sorted(TYPES))
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 8, 9])
def test_packed_bytes_are_the_ones_onnx_writes_and_read_back_exactly(dtype_name, count):
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, dtype_name))
    info = ml_dtypes.iinfo(dtype) if "int" in dtype_name else None
    if info is not None:
        values = np.arange(count) % (int(info.max) - int(info.min) + 1) + int(info.min)
    else:
        values = [0.5, 1.0, 2.0, 4.0, 0.25, 8.0, 1.0, 2.0, 0.5][:count]
    array = np.array(values).astype(dtype)
    kind = exotic_type(dtype)
    raw = to_raw(array, kind)
    # onnx's own packing (numpy_helper) is the independent reference
    assert raw.tobytes() == numpy_helper.from_array(array).raw_data
    back = from_raw(raw, array.shape, kind)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back.astype(np.float32), array.astype(np.float32))


def _round_trip(onnx_type: int) -> bytes:
    """x -> float32 -> x: Casts both ways (ONNX Runtime has no Identity for int2)."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["f"], ["y"], to=onnx_type),
        ],
        "round_trip",
        [helper.make_tensor_value_info("x", onnx_type, [5])],
        [helper.make_tensor_value_info("y", onnx_type, [5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    model.ir_version = 11
    return model.SerializeToString()


@pytest.mark.parametrize(
    ("dtype_name", "engines"),
    [("int2", ["onnxrt"]), ("uint2", ["onnxrt"]), ("float8_e8m0fnu", ["onnxrt", "openvino"])],
)
def test_onnx_1_23_types_come_back_as_declared(dtype_name, engines):
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, dtype_name))
    values = [1, 0, -1, -2, 1] if dtype_name == "int2" else [1, 0, 3, 2, 1]
    if dtype_name.startswith("float"):
        values = [0.5, 1.0, 2.0, 4.0, 64.0]
    x = np.array(values).astype(dtype)
    x.flags.writeable = False
    for engine in engines:
        session = xrt.InferenceSession(_round_trip(TYPES[dtype_name][0]), engine=engine)
        (y,) = session.run([x])
        assert y.dtype == dtype, engine
        np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32))


def test_openvino_says_which_type_it_cannot_read():
    with pytest.raises(xrt.ModelLoadError, match="Unsupported data type INT2"):
        xrt.InferenceSession(
            _round_trip(TensorProto.INT2), engine="openvino", policy={"strict": True}
        )

import numpy as np
import pytest

import xpuruntime as xrt


def test_missing_model_file(tmp_path):
    with pytest.raises(xrt.ModelLoadError, match="not found"):
        xrt.InferenceSession(tmp_path / "absent.onnx")


def test_truncated_model_file(tmp_path, conv_model):
    path = tmp_path / "truncated.onnx"
    path.write_bytes(conv_model[: len(conv_model) // 2])
    with pytest.raises(xrt.ModelLoadError, match="truncated.onnx"):
        xrt.InferenceSession(path)


def test_garbage_and_empty_bytes():
    with pytest.raises(xrt.ModelLoadError):
        xrt.InferenceSession(b"\x08\x07garbage\xff\xff")
    with pytest.raises(xrt.ModelLoadError, match="empty"):
        xrt.InferenceSession(b"")
    with pytest.raises(xrt.ModelLoadError, match="expected a path, bytes"):
        xrt.InferenceSession(12345)


def test_model_rejected_by_the_checker():
    from onnx import TensorProto, helper

    # Relu fed by a name nothing produces: a broken graph.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["nothing"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    with pytest.raises(xrt.ModelLoadError, match="checker"):
        xrt.InferenceSession(model.SerializeToString())


def test_model_from_path_bytes_and_proto_agree(tmp_path, mlp_model):
    import onnx

    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp_model)
    x = np.ones((2, 16), np.float32)
    results = [
        xrt.InferenceSession(src).run({"x": x})[0]
        for src in (path, str(path), mlp_model, onnx.load_from_string(mlp_model))
    ]
    assert all(np.array_equal(results[0], r) for r in results)


@pytest.mark.parametrize("engine", ["onnxrt", "openvino"])
def test_external_data_models_load_from_a_path(tmp_path, mlp_model, engine):
    import onnx

    model = onnx.load_from_string(mlp_model)
    path = tmp_path / "ext.onnx"
    onnx.save_model(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.bin",
        size_threshold=0,
    )
    x = np.ones((3, 16), np.float32)
    expected = xrt.InferenceSession(mlp_model).run({"x": x})[0]
    session = xrt.InferenceSession(path, engine=engine)
    assert np.allclose(session.run({"x": x})[0], expected, rtol=1e-5, atol=1e-6)
    weights = (tmp_path / "ext.bin").stat().st_size
    assert session.model.nbytes == path.stat().st_size + weights  # the size counts them too
    before = session.model.digest
    (tmp_path / "ext.bin").write_bytes((tmp_path / "ext.bin").read_bytes()[::-1])
    assert xrt.inference.Model.load(path).digest != before  # digest covers external data

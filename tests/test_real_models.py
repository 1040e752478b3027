"""Real models that PyPI packages ship inside their wheels, on both engines."""

import numpy as np
import pytest

import xpuruntime as xrt


def test_ppocr_detection_agrees_across_engines(ppocr_det_model):
    image = np.random.default_rng(0).uniform(-1, 1, (1, 3, 320, 320)).astype(np.float32)
    report = xrt.compare(
        ppocr_det_model, engines=["onnxrt", "openvino"], inputs={"x": image}, rtol=1e-3, atol=1e-4
    )
    assert report.passed, str(report)
    (row,) = [r for r in report.rows if r.engine == "openvino"]
    assert 0 < row.rel_l2 < 1e-2  # different kernels, same maths (sigmoid outputs near 0)


def test_ppocr_recognition_runs_on_both_engines(ppocr_rec_model):
    session = xrt.InferenceSession(ppocr_rec_model)
    (spec,) = session.inputs
    assert spec.shape[1] == 3
    image = np.random.default_rng(1).uniform(-1, 1, (2, 3, 48, 320)).astype(np.float32)
    (ref,) = session.run({spec.name: image})
    (out,) = xrt.InferenceSession(ppocr_rec_model, engine="openvino").run([image])
    assert out.shape == ref.shape and np.allclose(out.sum(-1), 1, atol=1e-3)  # softmax rows
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-3


def test_magika_classifier_gives_the_same_label_on_both_engines(magika_model):
    session = xrt.InferenceSession(magika_model)
    (spec,) = session.inputs
    feeds = {
        spec.name: np.random.default_rng(2)
        .integers(0, 257, (4, *spec.shape[1:]))
        .astype(spec.dtype)
    }
    (ref,) = session.run(feeds)
    (out,) = xrt.InferenceSession(magika_model, engine="openvino").run(feeds)
    assert np.array_equal(ref.argmax(-1), out.argmax(-1))


def test_wrong_input_to_a_real_model_is_invalid_input(ppocr_det_model):
    session = xrt.InferenceSession(ppocr_det_model)
    with pytest.raises(xrt.InvalidInputError, match="'x': dimension 1 must be 3"):
        session.run({"x": np.zeros((1, 4, 64, 64), np.float32)})

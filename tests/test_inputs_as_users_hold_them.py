"""Arrays as users hold them: read-only, memory-mapped, non-owning, broadcast. Every
engine takes them, gives the results it gives for a writable copy, and never writes
to them (OpenVINO 2026.4's shared tensors refuse read-only arrays: they are copied)."""

from __future__ import annotations

import numpy as np
import pytest
from at_once import at_once

import xpuruntime as xrt

ENGINES = ["onnxrt", "openvino"]


def _same_as_for_a_writable_copy(session: xrt.InferenceSession, held: np.ndarray) -> None:
    before = np.array(held, copy=True)
    (out,) = session.run([held])
    (expected,) = session.run([np.array(held, copy=True)])
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(held, before)  # never written to


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pil_image_broadcast_to_three_channels(ppocr_cls_model, engine):
    image = pytest.importorskip("PIL.Image")
    page = np.random.default_rng(0).uniform(-1, 1, (48, 192)).astype(np.float32)
    gray = np.asarray(image.fromarray(page, mode="F"))  # read-only, as PIL exports it
    assert not gray.flags.writeable
    held = np.broadcast_to(gray, (1, 3, 48, 192))  # gray to RGB without a copy: stride 0
    session = xrt.InferenceSession(ppocr_cls_model, engine=engine, policy={"strict": True})
    _same_as_for_a_writable_copy(session, held)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_batch_memory_mapped_from_an_npy_file(ppocr_det_model, engine, tmp_path):
    batch = np.random.default_rng(1).uniform(-1, 1, (2, 3, 64, 96)).astype(np.float32)
    np.save(tmp_path / "batch.npy", batch)
    held = np.load(tmp_path / "batch.npy", mmap_mode="r")
    assert isinstance(held, np.memmap) and not held.flags.writeable
    session = xrt.InferenceSession(ppocr_det_model, engine=engine, policy={"strict": True})
    _same_as_for_a_writable_copy(session, held)


@pytest.mark.parametrize("engine", ENGINES)
def test_features_read_from_bytes_with_frombuffer(magika_model, engine):
    features = np.random.default_rng(2).integers(0, 257, (3, 2048)).astype(np.int32)
    held = np.frombuffer(features.tobytes(), np.int32).reshape(3, 2048)  # owns nothing
    assert not held.flags.writeable and not held.flags.owndata
    session = xrt.InferenceSession(magika_model, engine=engine, policy={"strict": True})
    _same_as_for_a_writable_copy(session, held)


@pytest.mark.parametrize("engine", ENGINES)
def test_read_only_and_writable_inputs_from_threads_at_once(ppocr_cls_model, engine):
    session = xrt.InferenceSession(ppocr_cls_model, engine=engine, policy={"strict": True})
    rng = np.random.default_rng(3)
    batches = [rng.uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32) for _ in range(4)]
    expected = [session.run([b])[0] for b in batches]
    for index in (1, 3):
        batches[index].flags.writeable = False
    wrong: list[object] = []

    def serve(index: int) -> None:
        for _ in range(10):
            try:
                out = session.run([batches[index]])[0]
            except Exception as e:
                wrong.append(e)
                return
            if not np.array_equal(out, expected[index]):
                wrong.append(index)

    at_once(serve, threads=4, timeout=120)
    assert wrong == []

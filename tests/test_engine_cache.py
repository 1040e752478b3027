"""EngineCache: content addressing, verification on load, LRU cap, several processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xpuruntime as xrt
from xpuruntime.engines._cache import EngineCache


def _payload(seed: int, size: int = 4096) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_key_changes_with_any_part_and_not_with_order():
    base = dict(model="m" * 64, engine="openvino", version="2026.4", shapes={"x": [1, 3]})
    assert EngineCache.key(**base) == EngineCache.key(**dict(reversed(list(base.items()))))
    for field, other in [("model", "n" * 64), ("version", "2026.5"), ("shapes", {"x": [2, 3]})]:
        assert EngineCache.key(**{**base, field: other}) != EngineCache.key(**base)


def test_put_then_get_returns_the_same_bytes_and_metadata(tmp_path):
    cache = EngineCache(tmp_path)
    key, data = EngineCache.key(n=1), _payload(1)
    cache.put(key, data, {"engine": "test"})
    assert cache.get(key) == data
    (entry,) = cache.entries
    assert (entry.key, entry.size, entry.meta) == (key, len(data), {"engine": "test"})
    assert cache.get(EngineCache.key(n=2)) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_entry_is_detected_discarded_and_logged(tmp_path, caplog, damage):
    cache = EngineCache(tmp_path)
    key = EngineCache.key(n=1)
    path = cache.put(key, _payload(1))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) - 100])
    elif damage == "flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    else:
        path.write_bytes(b"not an engine")
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(key) is None
    assert not path.exists()
    assert "discarding" in caplog.text and "rebuilt" in caplog.text


def test_eviction_keeps_the_most_recently_used_entries_under_the_cap(tmp_path):
    cache = EngineCache(tmp_path, max_bytes=3 * 4096 + 3 * 200)
    keys = [EngineCache.key(n=i) for i in range(3)]
    for i, key in enumerate(keys):
        cache.put(key, _payload(i))
        os.utime(cache._path(key), (time.time() - 100 + i, time.time() - 100 + i))
    assert cache.get(keys[0]) is not None  # now the most recently used
    cache.put(EngineCache.key(n=3), _payload(3))
    present = {e.key for e in cache.entries}
    assert keys[1] not in present and keys[0] in present and EngineCache.key(n=3) in present
    assert cache.total_bytes <= cache.max_bytes


def test_bad_keys_and_payloads_are_rejected(tmp_path):
    cache = EngineCache(tmp_path)
    with pytest.raises(xrt.InvalidInputError, match="64 hex"):
        cache.get("../../etc/passwd")
    with pytest.raises(xrt.InvalidInputError, match="bytes"):
        cache.put(EngineCache.key(n=1), "text")
    with pytest.raises(xrt.InvalidInputError, match="max_bytes"):
        EngineCache(tmp_path, max_bytes=0)


def _hammer(root: str, worker: int) -> int:
    cache = EngineCache(root, max_bytes=6 * 70_000)
    bad = 0
    for round_ in range(30):
        n = (worker + round_) % 8
        key = EngineCache.key(n=n)
        data = cache.get(key)
        if data is not None and data != _payload(n, 65_536):
            bad += 1
        cache.put(key, _payload(n, 65_536))
    return bad


def test_several_processes_sharing_a_cache_never_read_a_partial_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        bad = pool.starmap(_hammer, [(str(tmp_path), w) for w in range(4)])
    assert bad == [0, 0, 0, 0]
    assert EngineCache(tmp_path).total_bytes <= 6 * 70_000


def test_openvino_sessions_store_reuse_and_rebuild_their_compiled_model(conv_model, caplog):
    pytest.importorskip("openvino")
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    first = xrt.InferenceSession(conv_model, engine="openvino")
    assert first.engine_settings["engine_cache"].startswith("stored")
    second = xrt.InferenceSession(conv_model, engine="openvino")
    assert second.engine_settings["engine_cache"].startswith("hit")
    np.testing.assert_array_equal(first.run({"image": x})[0], second.run({"image": x})[0])

    cache = EngineCache(xrt.default_cache_dir() / "engines")
    (entry,) = cache.entries
    path = cache._path(entry.key)
    path.write_bytes(path.read_bytes()[:-10])  # cut short, as by a crash or a full disk
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        third = xrt.InferenceSession(conv_model, engine="openvino")
    assert third.engine_settings["engine_cache"].startswith("stored")
    assert "truncated" in caplog.text
    np.testing.assert_array_equal(first.run({"image": x})[0], third.run({"image": x})[0])


def test_an_openvino_engine_built_where_the_cpu_computed_otherwise_is_not_reused(
    conv_model, monkeypatch, tmp_path
):
    """CPUs report names as generic as "AMD EPYC": a compiled model is keyed on what the
    device computes with too (OpenVINO's OPTIMIZATION_CAPABILITIES: BF16, INT8, ...), so
    one built where they differ is not imported here."""
    ov = pytest.importorskip("openvino")
    policy = {"engine": "openvino", "cache_dir": str(tmp_path)}
    first = xrt.InferenceSession(conv_model, policy=policy)
    assert first.engine_settings["engine_cache"].startswith("stored")
    reported = ov.Core.get_property

    def without_bf16(core, *args):
        value = reported(core, *args)
        if args[-1:] == ("OPTIMIZATION_CAPABILITIES",):
            return [c for c in value if c != "BF16"] + ["OTHER_ISA"]
        return value

    monkeypatch.setattr(ov.Core, "get_property", without_bf16)
    other = xrt.InferenceSession(conv_model, policy=policy)
    assert other.engine_settings["engine_cache"].startswith("stored")  # a miss, rebuilt
    monkeypatch.undo()
    again = xrt.InferenceSession(conv_model, policy=policy)
    assert again.engine_settings["engine_cache"].startswith("hit")


# -- an entry proves which key it belongs to ------------------------------------------------
def test_another_models_valid_entry_in_this_place_is_refused_and_removed(tmp_path, caplog):
    cache = EngineCache(tmp_path)
    mine, theirs = EngineCache.key(model="a"), EngineCache.key(model="b")
    cache.put(mine, _payload(1))
    other = cache.put(theirs, _payload(2))
    os.replace(other, cache._path(mine))  # a valid entry, filed under the wrong key
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(mine) is None
    assert "another key" in caplog.text
    assert not cache._path(mine).exists()


def test_a_symlink_to_another_entry_is_not_followed(tmp_path):
    cache = EngineCache(tmp_path)
    mine, theirs = EngineCache.key(model="a"), EngineCache.key(model="b")
    target = cache.put(theirs, _payload(2))
    path = cache._path(mine)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.symlink_to(target)
    assert cache.get(mine) is None
    assert not path.is_symlink()
    assert cache.get(theirs) == _payload(2)  # the link's target is left alone


@pytest.mark.parametrize("form", ["directory", "fifo", "huge_length", "zero_length", "bad_json"])
def test_every_damaged_form_is_a_logged_miss_and_can_be_rebuilt(tmp_path, caplog, form):
    import struct

    cache = EngineCache(tmp_path)
    key = EngineCache.key(n=1)
    path = cache.put(key, _payload(1))
    raw = path.read_bytes()
    magic = b"XRTENGINE2\n"
    path.unlink()
    if form == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif form == "fifo":
        os.mkfifo(path, 0o600)
    elif form == "huge_length":
        path.write_bytes(magic + struct.pack("<Q", 2**63 - 1) + raw[len(magic) + 8 :])
    elif form == "zero_length":
        path.write_bytes(magic + struct.pack("<Q", 0) + raw[len(magic) + 8 :])
    else:
        path.write_bytes(magic + struct.pack("<Q", 5) + b"{{{{{" + b"x" * 100)
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(key) is None  # bounded time: the FIFO is not read
    assert "discarding" in caplog.text
    assert cache.put(key, _payload(1)) is not None
    assert cache.get(key) == _payload(1)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(offset=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_is_detected(tmp_path, offset, value):
    cache = EngineCache(tmp_path)
    key = EngineCache.key(n=7)
    path = cache.put(key, _payload(7, 512))
    raw = bytearray(path.read_bytes())
    offset %= len(raw)
    if raw[offset] == value:
        return
    raw[offset] = value
    path.write_bytes(bytes(raw))
    result = cache.get(key)
    # A change in the metadata text that keeps the JSON valid and the key intact is
    # harmless; anything else is caught. Never the wrong payload.
    assert result is None or result == _payload(7, 512)


# -- private to its user ---------------------------------------------------------------------
def test_directories_and_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        cache = EngineCache(tmp_path / "fresh" / "engines")
        path = cache.put(EngineCache.key(n=1), _payload(1))
    finally:
        os.umask(old)
    for directory in (tmp_path / "fresh", cache.root, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((cache.root / ".lock").stat().st_mode) == 0o600


def test_a_directory_others_can_write_is_not_used(tmp_path, caplog):
    cache = EngineCache(tmp_path / "engines")
    key = EngineCache.key(n=1)
    cache.put(key, _payload(1))
    os.chmod(cache.root, 0o777)
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(key) is None
        assert cache.put(key, _payload(1)) is None
    assert "writable by other users" in caplog.text
    assert "writable by other users" in cache.problem


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_an_entry_owned_by_another_user_is_refused(tmp_path, caplog):
    cache = EngineCache(tmp_path / "engines")
    key = EngineCache.key(n=1)
    path = cache.put(key, _payload(1))
    os.chown(path, 12345, -1)
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(key) is None
    assert "belongs to uid 12345" in caplog.text
    assert path.exists()  # refused, not deleted


# -- an unusable directory means running without the cache -----------------------------------
def test_a_file_in_place_of_the_cache_directory_is_a_logged_miss(tmp_path, caplog):
    (tmp_path / "engines").write_bytes(b"a file")
    cache = EngineCache(tmp_path / "engines")
    with caplog.at_level(logging.WARNING, logger="xpuruntime.engines"):
        assert cache.get(EngineCache.key(n=1)) is None
        assert cache.put(EngineCache.key(n=1), _payload(1)) is None
    assert "running without it" in caplog.text
    assert "not a directory" in cache.note.lower()


def test_a_full_disk_is_a_logged_miss(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root); the full-disk path is untested")
    try:
        cache = EngineCache(mount / "engines")
        assert cache.put(EngineCache.key(n=1), _payload(1, 200_000)) is None
        assert "No space left" in cache.note
        assert not list((mount / "engines").glob("*/.*.tmp"))  # nothing half-written
    finally:
        os.system(f"umount {mount}")


def test_sessions_run_without_a_cache_directory_they_cannot_use(tmp_path, conv_model):
    pytest.importorskip("openvino")
    blocker = tmp_path / "blocked"
    blocker.write_bytes(b"a file where the cache directory should be")
    session = xrt.InferenceSession(
        conv_model, engine="openvino", policy={"cache_dir": str(blocker), "strict": True}
    )
    assert session.engine_settings["engine_cache"].startswith("not used")
    x = np.zeros((1, 3, 32, 32), np.float32)
    assert session.run({"image": x})[0].shape == (1, 10)


# -- leftovers and the cap -------------------------------------------------------------------
def test_temp_files_of_dead_writers_are_removed_and_counted(tmp_path):
    cache = EngineCache(tmp_path, max_bytes=10 * 4096)
    key = EngineCache.key(n=1)
    path = cache.put(key, _payload(1))
    dead = subprocess_pid_that_exited()
    orphan = path.parent / f".{path.name}.{dead}.abcd1234.tmp"
    orphan.write_bytes(b"x" * 1000)
    live = path.parent / f".{path.name}.{os.getpid()}.efgh5678.tmp"
    live.write_bytes(b"y" * 1000)
    assert cache.total_bytes == path.stat().st_size + 2000
    cache.evict()
    assert not orphan.exists() and live.exists()


def test_an_entry_over_the_cap_is_not_kept_and_says_so(tmp_path):
    cache = EngineCache(tmp_path, max_bytes=1000)
    kept = cache.put(EngineCache.key(n=0), _payload(0, 100))
    assert cache.put(EngineCache.key(n=1), _payload(1, 5000)) is None
    assert "over the cap" in cache.note
    assert kept.exists()


def subprocess_pid_that_exited() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- the engine's side: only a verified artifact is stored -----------------------------------
def test_openvino_stores_an_engine_only_after_the_reimported_copy_matches(conv_model):
    pytest.importorskip("openvino")
    session = xrt.InferenceSession(conv_model, engine="openvino")
    state = session.engine_settings["engine_cache"]
    assert state.startswith("stored"), state


def test_external_data_change_is_a_new_engine(tmp_path):
    pytest.importorskip("openvino")
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="w.bin", size_threshold=0)
    x = {"x": np.ones((1, 4), np.float32)}
    first = xrt.InferenceSession(path, engine="openvino")
    np.testing.assert_array_equal(first.run(x)[0], np.full((1, 4), 4, np.float32))
    (tmp_path / "w.bin").write_bytes((np.ones((4, 4), np.float32) * 2).tobytes())
    second = xrt.InferenceSession(path, engine="openvino")
    assert not second.engine_settings["engine_cache"].startswith("hit")
    np.testing.assert_array_equal(second.run(x)[0], np.full((1, 4), 8, np.float32))

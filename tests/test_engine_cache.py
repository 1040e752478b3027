"""EngineCache: content addressing, verification on load, LRU cap, several processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time

import numpy as np
import pytest

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

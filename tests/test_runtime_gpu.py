"""The CUDA runtime on a real GPU: streams, events, memory, graphs, device properties."""

from __future__ import annotations

import numpy as np
import pytest

import xpuruntime as xrt
from xpuruntime.runtime import CudaGraph, Event, MemoryManager, Stream

pytestmark = pytest.mark.gpu


def test_device_reports_real_cuda_properties():
    device = xrt.Device("cuda:0")
    assert device.sm_count > 0 and device.compute_capability >= (7, 0)
    assert 0 < device.free_memory <= device.total_memory
    assert device.driver_version and "." in device.driver_version


def test_events_time_a_copy_and_order_two_streams():
    mm = MemoryManager("cuda:0")
    n = 64 << 20
    src, dst = mm.allocate(n), mm.allocate(n)
    host = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    producer, consumer = Stream("cuda:0"), Stream("cuda:0")
    src.view(n, np.uint8).copy_from(host, producer)
    start = producer.record()
    producer.copy(dst.ptr, src.ptr, n)
    end = producer.record()
    consumer.wait(end)  # the consumer reads dst only after the copy
    out = dst.view(n, np.uint8).to_numpy(consumer)
    np.testing.assert_array_equal(out, host)
    assert end.done and start.elapsed_ms(end) > 0
    with pytest.raises(xrt.InvalidInputError, match="timing=False"):
        Event("cuda:0", timing=False).record(producer).elapsed_ms(end)


def test_streams_interoperate_with_torch_both_ways():
    torch = pytest.importorskip("torch")
    ours = Stream("cuda:0")
    theirs = torch.cuda.ExternalStream(ours.handle)
    with torch.cuda.stream(theirs):
        x = torch.ones(1 << 20, device="cuda") * 3
    ours.synchronize()
    assert float(x.sum()) == 3 * (1 << 20)
    wrapped = Stream.wrap(torch.cuda.current_stream())
    assert wrapped.handle == torch.cuda.current_stream().cuda_stream
    assert ours.__cuda_stream__() == (0, ours.handle)


def test_streams_say_whether_they_wait_for_the_legacy_default_stream():
    for blocking in (False, True):
        ours = Stream("cuda:0", blocking=blocking)
        assert ours.blocking is blocking
        assert Stream.wrap(ours).blocking is blocking  # read back from the driver
    assert Stream.wrap(0, device=0).blocking  # the legacy default stream itself


def test_device_arrays_are_read_by_torch_without_a_copy():
    torch = pytest.importorskip("torch")
    mm = MemoryManager.instance("cuda:0")
    array = mm.allocate(4 * 1000).view((10, 100), np.float32)
    array.copy_from(np.arange(1000, dtype=np.float32).reshape(10, 100))
    mm._default_stream.synchronize()
    tensor = torch.as_tensor(array, device="cuda")
    assert tensor.data_ptr() == array.ptr and float(tensor[9, 99]) == 999.0


def test_memory_manager_counts_reuses_and_explains_out_of_memory():
    mm = MemoryManager("cuda:0")
    before = mm.stats
    buffers = [mm.allocate(8 << 20) for _ in range(4)]
    stats = mm.stats
    assert stats.used - before.used >= 32 << 20 and stats.live_buffers == 4
    for b in buffers:
        b.free()
    mm._default_stream.synchronize()
    assert mm.stats.used == before.used and mm.stats.reserved >= 32 << 20  # kept for reuse
    mm.trim()
    mm._default_stream.synchronize()
    assert mm.stats.reserved <= stats.reserved
    free = xrt.Device("cuda:0").free_memory
    with pytest.raises(xrt.OutOfMemoryError, match="free of"):
        mm.allocate(free + (64 << 30))


def test_pinned_buffers_round_trip_through_the_device():
    mm = MemoryManager.instance("cuda:0")
    pinned = mm.allocate_pinned(1 << 20)
    host = pinned.view((256, 1024), np.float32)
    host[:] = np.random.default_rng(1).standard_normal(host.shape)
    device = mm.allocate(1 << 20).view((256, 1024), np.float32)
    stream = Stream("cuda:0")
    device.copy_from(host, stream)
    np.testing.assert_array_equal(device.to_numpy(stream), host)


def test_a_captured_graph_replays_its_copies():
    mm = MemoryManager.instance("cuda:0")
    n = 1 << 20
    a, b = mm.allocate(n), mm.allocate(n)
    stream = Stream("cuda:0")
    graph = CudaGraph()
    with graph.capture(stream):
        stream.copy(b.ptr, a.ptr, n)
    assert graph.captured and graph.node_count == 1
    for seed in range(3):
        data = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
        a.view(n, np.uint8).copy_from(data, stream)
        graph.replay(stream)
        np.testing.assert_array_equal(b.view(n, np.uint8).to_numpy(stream), data)
    graph.close()


def test_a_host_synchronisation_during_capture_is_a_clear_error():
    stream = Stream("cuda:0")
    graph = CudaGraph()
    with pytest.raises(xrt.CudaError, match="CUDA_ERROR_STREAM_CAPTURE"):
        with graph.capture(stream):
            stream.synchronize()
    assert not graph.captured


def test_profiler_times_a_range_on_a_stream(tmp_path):
    prof = xrt.Profiler.instance()
    prof.clear()
    prof.enable()
    try:
        mm = MemoryManager.instance("cuda:0")
        n = 256 << 20
        a, b = mm.allocate(n), mm.allocate(n)
        stream = Stream("cuda:0")
        with prof.range("copy 256 MiB", stream=stream):
            stream.copy(b.ptr, a.ptr, n)
        device = [e for e in prof.events if e["pid"] == "cuda"]
        assert len(device) == 1 and device[0]["args"]["device_ms"] > 0
        prof.export_chrome_trace(tmp_path / "t.json")
    finally:
        prof.disable()
        prof.clear()

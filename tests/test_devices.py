import subprocess
import sys

import pytest

import xpuruntime as xrt


def test_cpu_is_always_discovered_with_host_facts():
    cpu = xrt.get_all_devices()[0]
    assert cpu == xrt.Device("cpu")
    info = cpu.info
    assert info.kind == "cpu" and info.backend == "os" and info.name
    assert info.total_memory > 2**28 and info.sm_count is None
    assert xrt.get_device_count("cpu") == 1


@pytest.mark.parametrize(
    "spec, kind, index, text",
    [
        ("cpu", "cpu", 0, "cpu"),
        ("CUDA:1", "cuda", 1, "cuda:1"),
        ("npu", "npu", 0, "npu:0"),
        ("gpu:3", "gpu", 3, "gpu:3"),
        ("auto", "auto", 0, "auto"),
    ],
)
def test_device_specs_parse_without_touching_hardware(spec, kind, index, text):
    device = xrt.Device(spec)
    assert (device.kind, device.index, str(device)) == (kind, index, text)


def test_the_seed_form_device_index_reads_the_device_at_construction():
    # 03_python_binding §6.2: Device(i) reads the device's information in __init__.
    missing = xrt.get_device_count("cuda") + 1
    with pytest.raises(xrt.CudaError, match=f"cuda:{missing}"):
        xrt.Device(missing)
    assert xrt.Device("cpu") == "cpu" and xrt.Device("cuda:7") == 7  # names never raise


@pytest.mark.parametrize("spec", ["tpu", "cuda:-1", "cpu:1", "", -1, None, "cuda:x"])
def test_malformed_device_spec_is_invalid_input(spec):
    with pytest.raises(xrt.InvalidInputError, match="device"):
        xrt.Device(spec)


def test_missing_cuda_device_is_a_cuda_error_that_says_why():
    count = xrt.get_device_count("cuda")
    with pytest.raises(xrt.CudaError, match=f"cuda:{count} not found") as info:
        xrt.Device(count).info
    assert info.value.code == "CUDA_ERROR_INVALID_DEVICE"


def test_missing_npu_is_unsupported_not_a_crash():
    if xrt.get_device_count("npu"):
        pytest.skip("this machine has an NPU")
    with pytest.raises(xrt.UnsupportedOperationError, match="npu:0 not found"):
        xrt.Device("npu").info
    assert not xrt.Device("npu").exists


def test_every_probe_reports_found_or_a_reason():
    reports = xrt.DeviceManager.instance().probes
    assert {r.backend for r in reports} >= {"os", "openvino", "onnxruntime"}
    assert all(r.ok or r.detail for r in reports)


def test_current_device_defaults_to_cpu_and_synchronize_is_safe():
    assert xrt.get_current_device() == "cpu"
    xrt.set_current_device("cpu")
    xrt.synchronize()
    with pytest.raises(xrt.CudaError):
        xrt.set_current_device(xrt.get_device_count("cuda"))


def test_a_failing_probe_becomes_a_reason(monkeypatch):
    from xpuruntime.runtime import _discovery

    def broken(record):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(_discovery, "_probe_openvino", broken)
    reports = _discovery.probe_all(xrt.DeviceInfo)
    assert any(not r.ok and "driver exploded" in r.detail for r in reports)
    assert reports[0].devices  # the CPU is still there


@pytest.mark.gpu
def test_cuda_devices_report_real_properties():
    info = xrt.Device("cuda:0").info
    assert info.compute_capability >= (7, 0) and info.total_memory > 2**30
    assert info.supports_fp16 and info.backend in ("cuda-bindings", "nvml")
    xrt.set_current_device("cuda:0")
    xrt.synchronize()
    xrt.set_current_device("cpu")


def test_import_loads_no_backend():
    code = (
        "import sys, xpuruntime; print([m for m in ('torch', 'onnxruntime', 'openvino', "
        "'triton', 'onnx', 'numpy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

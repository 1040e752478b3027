import json

import numpy as np
import pytest

import xpuruntime as xrt
from xpuruntime.cli import main


def test_compare_reports_metrics_per_engine_and_output(conv_model):
    report = xrt.compare(
        conv_model, engines=["onnxrt", "openvino"], seed=3, shapes={"image": (2, 3, 32, 32)}
    )
    assert [r.engine for r in report.rows] == ["onnxrt", "openvino"]
    onnxrt, openvino = report.rows
    assert onnxrt.max_abs == 0 and onnxrt.rel_l2 == 0  # the reference against itself
    assert openvino.passed and openvino.max_abs < 1e-5
    assert json.loads(json.dumps(report.to_dict()))["rows"][1]["engine"] == "openvino"


def test_compare_marks_an_engine_that_cannot_run_as_failed(mlp_model):
    report = xrt.compare(mlp_model, engines=["onnxrt", "tensorrt"])
    bad = [r for r in report.rows if r.engine == "tensorrt"]
    assert not report.passed and bad and bad[0].error


def test_compare_metric_definitions():
    from xpuruntime.inference._compare import compare_outputs

    ref = np.array([1.0, -2.0, 4.0], np.float32)
    out = ref + np.array([0.0, 0.02, -0.04], np.float32)
    (row,) = compare_outputs("e", ["y"], [out], [ref], rtol=0.01, atol=0.0)
    assert row.max_abs == pytest.approx(0.04, rel=1e-5)
    assert row.max_rel == pytest.approx(0.01, rel=1e-4)
    assert row.rel_l2 == pytest.approx(np.sqrt(0.02**2 + 0.04**2) / np.sqrt(21), rel=1e-4)
    assert row.passed
    (row,) = compare_outputs("e", ["y"], [out], [ref], rtol=0.005, atol=0.0)
    assert not row.passed


def test_cli_devices_and_demo(capsys):
    assert main(["devices"]) == 0
    assert "cpu" in capsys.readouterr().out
    assert main(["demo", "--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "onnxrt" in out and "openvino" in out and "pass" in out


def test_cli_run_bench_compare(tmp_path, mlp_model, capsys):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp_model)
    np.savez(tmp_path / "in.npz", x=np.ones((3, 16), np.float32))
    assert main(["run", str(path), "--input", str(tmp_path / "in.npz"), "--explain"]) == 0
    assert "(3, 8)" in capsys.readouterr().out
    assert main(["bench", str(path), "--seconds", "0.05", "--shape", "x=4x16"]) == 0
    assert "p50" in capsys.readouterr().out
    assert main(["compare", str(path), "--engines", "onnxrt,openvino"]) == 0


def test_cli_policy_show_and_validate(tmp_path, capsys):
    path = xrt.KernelPolicy(matmul="cublasLt").save(tmp_path / "k.yaml")
    assert main(["policy", "validate", str(path)]) == 0
    assert "valid KernelPolicy" in capsys.readouterr().out
    path = xrt.ExecutionPolicy(engine="openvino").save(tmp_path / "e.json")
    assert main(["policy", "show", str(path)]) == 0
    assert '"openvino"' in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"kernels": {"matmul": "x"}}')
    assert main(["policy", "validate", str(tmp_path / "bad.json")]) == 2
    assert "PolicyError" in capsys.readouterr().err


def test_cli_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["run", str(tmp_path / "none.onnx")]) == 2
    assert "ModelLoadError" in capsys.readouterr().err


@pytest.mark.parametrize(
    "example, needle",
    [
        ("inference_basic.py", "engine:"),
        ("npu_inference.py", "engine:"),
        ("training_kernel_policy.py", "attention  flash_v2   policy    forward"),
    ],
)
def test_examples_run(example, needle):
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / example
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert needle in out.stdout


def test_cli_bench_int8_throughput_and_json_report(tmp_path, mlp_model, capsys):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp_model)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((6, 4, 16)).astype(np.float32))
    report = tmp_path / "report.json"
    args = ["bench", str(path), "--seconds", "0.1", "--shape", "x=4x16", "--json", str(report)]
    quantized = [*args, "--precision", "int8", "--calibration", str(tmp_path / "cal.npz")]
    assert main([*quantized, "--engines", "onnxrt"]) == 0
    data = json.loads(report.read_text())
    (row,) = data["rows"]
    assert data["calibration_batches"] == 6 and data["policy"]["precision"] == "int8"
    assert row["precision"].startswith(("int8 by", "fp32 (int8 fell back")) or "error" in row
    assert main([*args, "--performance", "throughput", "--concurrency", "3"]) == 0
    data = json.loads(report.read_text())
    assert data["concurrency"] == 3 and data["cores"] >= 1
    for row in data["rows"]:
        assert row["results_per_s"] > 0 and row["runs"] >= 1 and row["p99_ms"] >= row["p50_ms"]
        assert row["performance"].startswith("throughput")
    # int8 needs calibration inputs; a stack of ragged batches is refused, naming it.
    assert main([*args, "--precision", "int8"]) == 2
    assert "--calibration" in capsys.readouterr().err
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 4, 16), np.float32), y=np.zeros((2, 1)))
    assert main([*args, "--precision", "int8", "--calibration", str(tmp_path / "bad.npz")]) == 2
    assert "leading axis" in capsys.readouterr().err

"""The README's quick start for a training user runs as written (on the CPU, our Triton
kernels under the interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def _block_after(heading: str) -> str:
    """The first ```python block of the README's section under ``heading``."""
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _printed_by(heading: str) -> str:
    """What the first Python block under ``heading`` prints, run as written (on the CPU
    our Triton kernels under the interpreter)."""
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _block_after(heading)], capture_output=True, text=True,
        env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_fine_tuning_quick_start_runs_as_written():
    printed = _printed_by("## Fine-tuning a Hugging Face model faster")
    assert "SwiGLU" in printed and "rotary" in printed


def test_the_whole_step_example_runs_as_written():
    assert float(_printed_by("A whole training step in one call").split()[-1]) > 0


def test_the_inference_example_runs_as_written(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    out = subprocess.run(
        [sys.executable, "-c", _block_after("## Running an ONNX model on every engine")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TensorSpec(name='image'" in out.stdout and (tmp_path / "policy.yaml").exists()

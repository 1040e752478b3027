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


def test_the_fine_tuning_quick_start_runs_as_written():
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    code = _block_after("## Fine-tuning a Hugging Face model faster")
    torch = pytest.importorskip("torch")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SwiGLU" in out.stdout and "rotary" in out.stdout


def test_the_whole_step_example_runs_as_written():
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    code = _block_after("A whole training step in one call")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) > 0

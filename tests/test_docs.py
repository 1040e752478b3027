"""The documentation site builds with nothing broken (``mkdocs build --strict``: every
page in the nav, every link, every API entry resolved from the docstrings), and the
README stays one screen per product."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()
    shutil.rmtree(tmp_path / "site")


def test_the_readme_is_short_and_keeps_its_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert 'pip install ".[onnxruntime,openvino]" && xpuruntime demo' in text
    assert "./scripts/test" in text


def _blocks() -> list[tuple[str, int, str]]:
    """(page, index, code) of every Python block on the docs pages that is not marked as
    a sketch (its first line ``# A sketch: ...`` says what the reader supplies)."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            if not code.startswith("# A sketch"):
                found.append((page.name, i, code))
    return found


@pytest.mark.parametrize(("page", "index", "code"), _blocks(), ids=lambda v: str(v)[:20])
def test_every_docs_block_not_marked_a_sketch_runs_on_the_cpu(tmp_path, page, index, code):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
        env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"{page} block {index}: {out.stderr[-3000:]}"

"""The command line: every bad argument gives one clear line on stderr and a non-zero
exit, never a traceback; fallbacks are reported once; piped tables keep their cells."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from xpuruntime.cli import demo_model_path, main


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xpuruntime.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shape", "x=1x3x32x32"], "no input 'x'; its inputs are ['image']"),
        (["--shape", "=1x3x32x32"], "no input ''"),
        (["--shape", "image=-1x3x32x32"], ">= 0"),
        (["--shape", "image=100000x3x32000x32000"], "elements"),
        (["--shape", "image=axb"], "NAME=DxDxD"),
        (["--seed", "-1"], "integer >= 0"),
    ],
)
def test_bad_run_arguments_are_one_line_errors(capsys, args, needle):
    with pytest.raises(SystemExit) if "--seed" in args else _no_raise():
        code = main(["run", str(demo_model_path()), *args])
        assert code == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()), err
    assert "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("content", ["corrupt", "pickled", "empty"])
def test_bad_input_files_are_one_line_errors(tmp_path, capsys, content):
    path = tmp_path / "in.npz"
    if content == "corrupt":
        path.write_bytes(b"PK\x03\x04 definitely not a zip")
    elif content == "pickled":
        np.savez(path, image=np.array([{"a": 1}], dtype=object))
    else:
        path.write_bytes(b"")
    assert main(["run", str(demo_model_path()), "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "Traceback" not in err
    assert pickle  # the pickled case above holds an object array


@pytest.mark.parametrize("seconds", ["nan", "-1", "0", "inf", "1e9", "soon"])
def test_bench_seconds_are_validated(capsys, seconds):
    with pytest.raises(SystemExit) as exited:
        main(["bench", str(demo_model_path()), "--seconds", seconds])
    assert exited.value.code == 2
    assert "seconds" in capsys.readouterr().err


def test_version():
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("xpuruntime ")


def test_a_fallback_is_reported_once_and_piped_tables_keep_their_notes():
    done = _cli("run", str(demo_model_path()), "--engine", "tensorrt", "--explain")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("falling back") == 1, done.stderr
    assert "warnings.warn" not in done.stderr  # no source line under the message
    bench = _cli("bench", str(demo_model_path()), "--seconds", "0.05", "--engines", "onnxrt,qnn")
    # The end of qnn's note, which a cut at 80 columns would lose.
    assert "so no fallback" in " ".join(bench.stdout.replace("│", " ").split())

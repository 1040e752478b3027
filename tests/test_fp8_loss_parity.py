"""benchmarks/fp8_loss_parity.py --compare: saved curves of several calls merged, each
precision averaged over its seeds and read against bf16's mean (the figures the FP8 loss
goal is judged by; read on the CPU from curves written by hand)."""

import json

import pytest
from benchmark_scripts import benchmark_script


def _script():
    return benchmark_script("fp8_loss_parity")


def _run(level: float, steps: int = 100) -> dict:
    """A flat curve at ``level``: every step's loss and every held-out loss."""
    return {"train": [level] * steps, "held_out": [level] * (steps // 25), "ms": 1.0}


def _write(tmp_path, name: str, runs: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"title": "curves", "runs": runs}))
    return str(path)


def test_curves_of_several_calls_are_averaged_over_seeds_and_read_against_bf16(tmp_path, capsys):
    script = _script()
    files = [
        _write(tmp_path, "seed0.json", {"bf16": _run(2.0), "fp8": _run(2.2)}),
        _write(tmp_path, "seed1.json", {"bf16@1": _run(2.0), "fp8@1": _run(1.8)}),
    ]
    runs = script.merged(files)["runs"]
    assert set(runs) == {"bf16", "fp8", "bf16@1", "fp8@1"}
    train, held = script.seed_means(runs, script._seeds(runs))["fp8"]
    assert train == pytest.approx([2.0] * 100) and held == pytest.approx([2.0] * 4)
    script.summary(runs)
    lines = capsys.readouterr().out.splitlines()
    each = {line.split(":")[0]: line for line in lines if " against " in line}
    assert "training loss +10.00%" in each["fp8 against bf16"]  # (each seed's run alone)
    assert "training loss -10.00%" in each["fp8@1 against bf16@1"]
    assert lines[-1] == (
        "fp8 against bf16, means over seeds 0,1: last 25 steps' training loss +0.00%, last "
        "held-out +0.00%; largest distance after step 50: training 0.00%, held out 0.00%"
    )


def test_a_run_named_in_two_files_is_refused_not_overwritten(tmp_path):
    script = _script()
    first = _write(tmp_path, "a.json", {"bf16": _run(2.0)})
    second = _write(tmp_path, "b.json", {"bf16": _run(3.0)})
    with pytest.raises(SystemExit, match=r"runs \['bf16'\] are in an earlier file"):
        script.merged([first, second])

"""A script of ``benchmarks/`` imported as a module, for tests of its pure parts."""

import importlib.util
from pathlib import Path
from types import ModuleType

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported afresh."""
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

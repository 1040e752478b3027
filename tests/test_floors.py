"""The layers of ``src/xpuruntime`` as they stand: every import (at the top of a file or
inside a function) goes from a room to itself or to a room on a lower floor. A new room
takes its place in :data:`FLOORS`; an import that runs up a floor, or a circle between
rooms, fails here with the file, the line and the two rooms; so does an import of a
module that does not exist (a relative import a move left behind)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"

FLOORS = (  # from the top floor down; a room is a package folder or a module
    "xpuruntime.cli",
    "xpuruntime",  # the package's face: what it hands on
    "xpuruntime.pytorch",  # the PyTorch wing's face
    "xpuruntime.pytorch.ops",  # the public ops' face
    "xpuruntime.pytorch._training",
    "xpuruntime.pytorch._optimize",
    "xpuruntime.pytorch._graphs",
    "xpuruntime.pytorch.nn",
    "xpuruntime.pytorch._functional",
    "xpuruntime.pytorch._selection",
    "xpuruntime.serving",
    "xpuruntime.pytorch.build",
    "xpuruntime.pytorch._kernels",
    "xpuruntime.pytorch.distributed",
    "xpuruntime.pytorch._linear_view",
    "xpuruntime.inference",
    "xpuruntime.pytorch._ops",
    "xpuruntime.pytorch._ops._infra",
    "xpuruntime.engines",
    "xpuruntime.kernels",
    "xpuruntime._inputs",
    "xpuruntime._metrics",
    "xpuruntime.policies",
    "xpuruntime.runtime",
    "xpuruntime._model",
    "xpuruntime._errors",
    "xpuruntime._files",
    "xpuruntime._timing",
)
"""Every room of the package, each above the rooms after it."""


def _exists(module: str) -> bool:
    path = SOURCE / Path(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    """The room ``module`` belongs to: the longest entry of FLOORS it is in."""
    best = None
    for room in FLOORS:
        if (module == room or module.startswith(room + ".")) and (
            best is None or len(room) > len(best)
        ):
            best = room
    return best


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of our package in ``path``, relative ones resolved
    (``from . import x`` as the module ``x`` where it is one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("xpuruntime")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("xpuruntime"):
                continue
            for alias in node.names:  # a submodule taken by name is that module
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if _exists(sub) else module))
    return found


def test_every_import_runs_down_the_floors_or_stays_in_its_room():
    order = {room: i for i, room in enumerate(FLOORS)}
    unplaced, upward, missing = [], [], []
    for path in sorted((SOURCE / "xpuruntime").rglob("*.py")):
        here = _room(_module_name(path))
        if here is None:
            unplaced.append(str(path.relative_to(SOURCE)))
            continue
        for line, module in _imports(path):
            if not _exists(module):  # (a relative import a move left pointing nowhere)
                missing.append(f"{path.relative_to(SOURCE)}:{line}: {module}")
                continue
            there = _room(module)
            if there is None or there == here:
                continue
            if order[there] < order[here]:
                upward.append(f"{path.relative_to(SOURCE)}:{line}: {here} imports {there}")
    assert not unplaced, f"rooms not in FLOORS: {unplaced}"
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_the_floors_name_every_room_once():
    assert len(set(FLOORS)) == len(FLOORS)
    assert all(_exists(room) for room in FLOORS), [r for r in FLOORS if not _exists(r)]

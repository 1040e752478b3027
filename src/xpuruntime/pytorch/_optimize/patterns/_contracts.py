"""The shapes a pattern takes, one ``Protocol`` each: what :func:`optimize`'s loop and
the rewritten forward call on the table's members. Every one lists the report's
findings it may add (``findings``), so that the table of findings and the patterns can
be checked against each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import nn

from .._report import Finding
from .._run import Run

__all__ = ["ForwardPart", "ModelPattern", "ModulePattern", "StatementKind"]


@runtime_checkable
class ModulePattern(Protocol):
    """Asked of every submodule in turn; True from ``apply`` settles the module."""

    findings: tuple[Finding, ...]

    def enabled(self, run: Run) -> bool: ...

    def apply(
        self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module
    ) -> bool: ...


@runtime_checkable
class ModelPattern(Protocol):
    """Applied once to the whole model, after the module patterns."""

    findings: tuple[Finding, ...]

    def enabled(self, run: Run) -> bool: ...

    def apply_model(self, run: Run) -> None: ...


@runtime_checkable
class StatementKind(Protocol):
    """Statements of a forward that the rewrite calls ``helper`` for (a kind of
    :func:`.._statements.rewritten_forward`)."""

    kind: str
    helper: Callable[..., Any]
    findings: tuple[Finding, ...]

    def takes(self, run: Run, module: nn.Module) -> bool: ...

    def accept(
        self, run: Run, module: nn.Module, path: str, found: list[tuple[str, ...]]
    ) -> list[str]: ...


@runtime_checkable
class ForwardPart(Protocol):
    """A global a rewritten forward calls in our function's place (the rotary
    embedding, the mask builders)."""

    findings: tuple[Finding, ...]

    def match(self, run: Run, path: str, module: nn.Module) -> Any: ...

"""The one selection mechanism: candidates, their support answers, decisions, the log.

:data:`registry` and :data:`dispatcher` are the process-wide instances that engines (and,
in :mod:`xpuruntime.pytorch`, kernels) register with and are selected through.
"""

import os
from pathlib import Path
from typing import Protocol

from ._decision import DECISION_SOURCES, Candidate, Decision, Support
from ._dispatch_log import DispatchLog, DispatchRecord
from ._dispatcher import Dispatcher, FallbackWarning
from ._measurements import MeasurementCache
from ._registry import KernelRegistry

registry = KernelRegistry()
dispatcher = Dispatcher(registry)


class DispatchObserver(Protocol):
    """What a wing that records evidence of the kernels that ran gives the one logging
    switch (``xpuruntime.pytorch`` records every op PyTorch runs): it starts and stops
    with the log and hands over what it has pending before the log is read."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def flush(self) -> None: ...


_observers: list[DispatchObserver] = []


def add_dispatch_observer(observer: DispatchObserver) -> None:
    """Have ``observer`` start and stop with the log (started now if the log is on)."""
    _observers.append(observer)
    if dispatcher.log.enabled:
        observer.start()


def enable_dispatch_logging() -> None:
    """Record every decision (engines and kernels) and, once ``xpuruntime.pytorch`` is
    imported, every matmul, attention, convolution and routed op PyTorch runs on this
    thread (and the backward passes it starts), until disabled."""
    dispatcher.log.enable()
    for observer in _observers:
        observer.start()


def disable_dispatch_logging() -> None:
    """Stop recording; records already taken are kept. Call on the enabling thread."""
    for observer in _observers:
        observer.stop()
    dispatcher.log.disable()


def get_dispatch_logs() -> list[DispatchRecord]:
    """The records, oldest first (waits for pending GPU timings)."""
    _flush()
    return dispatcher.log.records


def clear_dispatch_logs() -> None:
    """Forget every record."""
    _flush()
    dispatcher.log.clear()


def export_dispatch_logs(path: str | os.PathLike[str]) -> Path:
    """Write every record to ``path`` as JSON (atomically)."""
    _flush()
    return dispatcher.log.export_json(path)


def _flush() -> None:
    for observer in _observers:
        observer.flush()


__all__ = [
    "DECISION_SOURCES",
    "Candidate",
    "Decision",
    "DispatchLog",
    "DispatchRecord",
    "DispatchObserver",
    "Dispatcher",
    "FallbackWarning",
    "KernelRegistry",
    "MeasurementCache",
    "Support",
    "add_dispatch_observer",
    "clear_dispatch_logs",
    "disable_dispatch_logging",
    "dispatcher",
    "enable_dispatch_logging",
    "export_dispatch_logs",
    "get_dispatch_logs",
    "registry",
]

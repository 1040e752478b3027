"""The one selection mechanism: candidates, their support answers, decisions, the log.

:data:`registry` and :data:`dispatcher` are the process-wide instances that engines (and,
in :mod:`xpuruntime.pytorch`, kernels) register with and are selected through.
"""

from ._decision import DECISION_SOURCES, Candidate, Decision, Support
from ._dispatch_log import DispatchLog, DispatchRecord
from ._dispatcher import Dispatcher, FallbackWarning
from ._measurements import MeasurementCache
from ._registry import KernelRegistry

registry = KernelRegistry()
dispatcher = Dispatcher(registry)


def enable_dispatch_logging() -> None:
    """Start recording every decision in :data:`dispatcher`'s log."""
    dispatcher.log.enable()


def disable_dispatch_logging() -> None:
    """Stop recording decisions (records already taken are kept)."""
    dispatcher.log.disable()


def get_dispatch_logs() -> list[DispatchRecord]:
    """The recorded decisions, oldest first."""
    return dispatcher.log.records


def clear_dispatch_logs() -> None:
    """Forget the recorded decisions."""
    dispatcher.log.clear()


__all__ = [
    "DECISION_SOURCES",
    "Candidate",
    "Decision",
    "DispatchLog",
    "DispatchRecord",
    "Dispatcher",
    "FallbackWarning",
    "KernelRegistry",
    "MeasurementCache",
    "Support",
    "clear_dispatch_logs",
    "disable_dispatch_logging",
    "dispatcher",
    "enable_dispatch_logging",
    "get_dispatch_logs",
    "registry",
]

"""The seed documents' import path for :class:`ExecutionPolicy`
(``from xpuruntime.policies.execution_policy import ExecutionPolicy``)."""

from ._execution_policy import AccuracyPolicy, ExecutionPolicy

__all__ = ["AccuracyPolicy", "ExecutionPolicy"]

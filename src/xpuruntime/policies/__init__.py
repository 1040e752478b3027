"""Policies as data: which kernel runs each op, and where and how a session runs."""

from ._choices import AUTO_STRATEGIES, ENGINES, KERNEL_CHOICES, PRECISIONS, AutoSelectStrategy
from ._document import read_document
from ._execution_policy import INT8_GATE, AccuracyPolicy, ExecutionPolicy
from ._kernel_policy import KernelPolicy

__all__ = [
    "AUTO_STRATEGIES",
    "ENGINES",
    "KERNEL_CHOICES",
    "PRECISIONS",
    "INT8_GATE",
    "AccuracyPolicy",
    "AutoSelectStrategy",
    "ExecutionPolicy",
    "KernelPolicy",
    "read_document",
]

"""Inference: sessions, input validation, cross-engine accuracy, latency measurement."""

from .._inputs import InputValidator, generate_inputs, validate_inputs
from .._model import Model, TensorSpec
from ._compare import ComparisonReport, OutputComparison, compare
from ._session import InferenceSession
from ._timing import LatencyStats, measure_latency

__all__ = [
    "ComparisonReport",
    "InferenceSession",
    "InputValidator",
    "LatencyStats",
    "Model",
    "OutputComparison",
    "TensorSpec",
    "compare",
    "generate_inputs",
    "measure_latency",
    "validate_inputs",
]

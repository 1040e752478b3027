"""The vocabulary policies are written in, and the helper that checks a choice.

The vocabulary is data, not availability: a policy naming ``matmul="cublasLt"`` is valid
on a machine without CUDA (so that one policy file travels between machines); whether a
choice can run here is decided at dispatch time, with a reason.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._errors import PolicyError, shown

__all__ = [
    "AUTO_STRATEGIES",
    "ENGINES",
    "KERNEL_CHOICES",
    "OPTIMIZATION_LEVELS",
    "ORT_PROVIDERS",
    "PRECISIONS",
    "choose",
    "choose_engine",
]

AUTO_STRATEGIES = ("first_supported", "best_performance")

# op -> the kernels a policy may name for it. "auto" lets the dispatcher choose.
KERNEL_CHOICES: dict[str, tuple[str, ...]] = {
    "matmul": ("cublas", "cublasLt", "default", "auto"),
    "attention": ("flash_v2", "cudnn", "efficient", "math", "triton", "auto"),
    "conv": ("cudnn_benchmark", "cudnn_deterministic", "default", "auto"),
    "layernorm": ("torch", "fused", "auto"),
    "rmsnorm": ("torch", "fused", "auto"),
    "residual_layernorm": ("torch", "fused", "auto"),
    "cross_entropy": ("torch", "fused_linear", "auto"),
    "linear": ("torch", "fused", "auto"),
    "linear_gelu": ("torch", "fused", "cublaslt", "auto"),
    "mlp": ("torch", "cublaslt", "auto"),
}

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "default")


def choose(field: str, value: object, choices: Iterable[str]) -> str:
    """Return the canonical spelling of ``value`` among ``choices`` (case-insensitive).

    Raises
    ------
    PolicyError
        If ``value`` is not a string or not one of ``choices``; the message lists them.
    """
    choices = tuple(choices)
    if isinstance(value, str):
        for choice in choices:
            if choice.lower() == value.lower():
                return choice
    raise PolicyError(f"{field}: expected one of {list(choices)}, got {shown(value)}")


ENGINES = ("auto", "onnxrt", "openvino", "tensorrt", "qnn")
ENGINE_ALIASES = {"onnxruntime": "onnxrt", "ort": "onnxrt", "ov": "openvino", "trt": "tensorrt"}
ORT_PROVIDERS = ("cpu", "cuda", "tensorrt")
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


def choose_engine(value: object) -> str:
    """Canonical engine name (accepting the aliases ``onnxruntime``, ``ort``, ``ov``, ``trt``)."""
    if isinstance(value, str):
        value = ENGINE_ALIASES.get(value.lower(), value)
    return choose("engine", value, ENGINES)

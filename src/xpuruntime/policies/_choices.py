"""The vocabulary policies are written in, and the helper that checks a choice.

The vocabulary is data, not availability: a policy naming ``matmul="cublasLt"`` is valid
on a machine without CUDA (so that one policy file travels between machines); whether a
choice can run here is decided at dispatch time, with a reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from .._errors import PolicyError, shown

__all__ = [
    "ACCURACY_METRICS",
    "AUTO_STRATEGIES",
    "KERNEL_ALIASES",
    "AutoSelectStrategy",
    "choose_strategy",
    "ENGINES",
    "KERNEL_CHOICES",
    "OPTIMIZATION_LEVELS",
    "ORT_PROVIDERS",
    "PERFORMANCE_MODES",
    "PRECISIONS",
    "UNQUANTIZED_PRECISIONS",
    "choose",
    "choose_engine",
]

AUTO_STRATEGIES = ("first_supported", "best_performance")


class AutoSelectStrategy(str, Enum):
    """The seed API's names for the auto strategies; each is its strategy string, so
    either spelling is accepted wherever a strategy is."""

    FirstSupported = "first_supported"
    BestPerformance = "best_performance"


def choose_strategy(value: object) -> str:
    """The canonical auto strategy for ``value``: a strategy string, an
    :class:`AutoSelectStrategy`, or its name as the seed documents write it to files
    (``"BestPerformance"``, ``"AutoSelectStrategy.BestPerformance"``)."""
    if isinstance(value, AutoSelectStrategy):
        return value.value
    if isinstance(value, str):
        name = value.rsplit(".", 1)[-1]
        if name in AutoSelectStrategy.__members__:
            return AutoSelectStrategy[name].value
    return choose("auto_strategy", value, AUTO_STRATEGIES)


# op -> the kernels a policy may name for it, in the auto preference order (the one
# source of that order: ``first_supported`` takes the first that runs, and the PyTorch
# kernels are registered in it). "auto" lets the dispatcher choose.
KERNEL_CHOICES: dict[str, tuple[str, ...]] = {
    "matmul": ("cublasLt", "cublas", "default", "auto"),
    "attention": ("flash_v2", "cudnn", "flash_v4", "efficient", "triton", "math", "auto"),
    "conv": ("default", "cudnn_benchmark", "cudnn_deterministic", "auto"),
    "layernorm": ("fused", "torch", "auto"),
    "rmsnorm": ("fused", "torch", "auto"),
    "residual_layernorm": ("fused", "torch", "auto"),
    "residual_rmsnorm": ("fused", "torch", "auto"),
    "cross_entropy": ("fused_linear", "torch_chunked", "torch", "auto"),
    "linear": ("fused", "torch", "fp8", "fp8_rowwise", "auto"),
    "linear_gelu": ("cublasLt", "fused", "torch", "auto"),
    "mlp": ("cublasLt", "torch", "auto"),
    "projections": ("fused", "torch", "fp8", "fp8_rowwise", "auto"),
    "lora_linear": ("fused", "torch", "fp8", "fp8_rowwise", "auto"),
    "swiglu": ("fused", "torch", "fp8", "auto"),
    "geglu": ("fused", "torch", "fp8", "auto"),
    "rope": ("fused", "torch", "auto"),
    "rmsnorm_rope": ("fused", "torch", "auto"),
}

# The seed documents' kernel names -> ours (None: the op is left to PyTorch, which is
# what a policy that does not name the op does).
KERNEL_ALIASES: dict[tuple[str, str], str | None] = {
    ("conv", "cudnn"): "default",  # PyTorch's convolutions are cuDNN's, its settings kept
    ("attention", "torch"): None,  # SDPA chooses its own backend
}

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "auto", "default")
ACCURACY_METRICS = ("allclose", "rel_l2", "max_abs", "top1_agreement")
PERFORMANCE_MODES = ("latency", "throughput")
UNQUANTIZED_PRECISIONS = ("fp32", "bf16")


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

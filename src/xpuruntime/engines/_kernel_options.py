"""KernelPolicy keys mapped onto engine options, each reported as honoured or ignored.

A KernelPolicy is written for PyTorch's ops, but some of its keys have a counterpart in
an inference engine: the conv algorithm search of ONNX Runtime's CUDA EP, its attention
kernel mask (``sdpa_kernel``), TF32, deterministic compute, and TensorRT's tactic
sources. Keys without a counterpart are reported as ignored, with the reason, so that
``explain()`` never implies more control than there is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policies import KernelPolicy

__all__ = ["KernelOption", "cuda_ep_options", "tensorrt_ep_options"]

# ONNX Runtime's sdpa_kernel bit mask (AttentionBackend in attention_common.h).
_SDPA_KERNEL = {"flash_v2": 1, "efficient": 2, "cudnn": 8, "math": 16}
_CONV_SEARCH = {
    "cudnn_benchmark": "EXHAUSTIVE",
    "auto": "EXHAUSTIVE",
    "cudnn_deterministic": "DEFAULT",  # one fixed algorithm, the same on every run
    "default": "HEURISTIC",
}


@dataclass(frozen=True)
class KernelOption:
    """One policy key and what became of it in an engine."""

    key: str
    value: Any
    honoured: bool
    effect: str

    def __str__(self) -> str:
        verdict = "honoured" if self.honoured else "ignored"
        return f"{self.key}={self.value}: {verdict} ({self.effect})"


def cuda_ep_options(
    kernels: KernelPolicy | None, precision: str
) -> tuple[dict[str, Any], list[KernelOption]]:
    """ONNX Runtime CUDA EP provider options for ``kernels`` and the session precision.

    Returns the options to merge and the report rows.
    """
    options: dict[str, Any] = {"use_tf32": 0 if precision == "fp32" else 1}
    rows: list[KernelOption] = []
    if kernels is None:
        return options, rows
    for op, kernel in kernels.preferences.items():
        if op == "conv":
            options["cudnn_conv_algo_search"] = _CONV_SEARCH[kernel]
            rows.append(
                KernelOption(op, kernel, True, f"cudnn_conv_algo_search={_CONV_SEARCH[kernel]}")
            )
        elif op == "attention" and kernel in _SDPA_KERNEL:
            options["sdpa_kernel"] = _SDPA_KERNEL[kernel]
            rows.append(
                KernelOption(
                    op,
                    kernel,
                    True,
                    f"sdpa_kernel={_SDPA_KERNEL[kernel]} (ORT's fused attention ops)",
                )
            )
        elif op == "attention":
            rows.append(
                KernelOption(
                    op, kernel, False, "ONNX Runtime chooses among its own attention kernels"
                )
            )
        elif op == "matmul":
            rows.append(KernelOption(op, kernel, False, "the CUDA EP has no GEMM library switch"))
        else:
            rows.append(KernelOption(op, kernel, False, f"{op} is a PyTorch kernel choice"))
    if kernels.tf32 is not None:
        options["use_tf32"] = int(kernels.tf32)
        rows.append(KernelOption("tf32", kernels.tf32, True, f"use_tf32={int(kernels.tf32)}"))
    if kernels.deterministic:
        options.setdefault("cudnn_conv_algo_search", "DEFAULT")
        rows.append(
            KernelOption(
                "deterministic",
                True,
                True,
                "use_deterministic_compute and a fixed conv algorithm "
                f"(cudnn_conv_algo_search={options['cudnn_conv_algo_search']})",
            )
        )
    return options, rows


def tensorrt_ep_options(kernels: KernelPolicy | None) -> tuple[dict[str, Any], list[KernelOption]]:
    """TensorRT EP ``trt_tactic_sources`` for the policy's matmul and conv choices."""
    if kernels is None:
        return {}, []
    sources, rows = [], []
    matmul, conv = kernels.get("matmul"), kernels.get("conv")
    if matmul == "cublas":
        sources += ["+CUBLAS", "-CUBLAS_LT"]
    elif matmul == "cublasLt":
        sources += ["-CUBLAS", "+CUBLAS_LT"]
    if matmul in ("cublas", "cublasLt"):
        rows.append(KernelOption("matmul", matmul, True, "trt_tactic_sources " + ",".join(sources)))
    if conv in ("cudnn_benchmark", "cudnn_deterministic"):
        sources.append("+CUDNN")
        rows.append(KernelOption("conv", conv, True, "trt_tactic_sources +CUDNN"))
    return ({"trt_tactic_sources": ",".join(sources)} if sources else {}), rows

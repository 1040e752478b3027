"""Dispatch logging for PyTorch: every matmul, attention, convolution and routed op that
runs, with the kernel it actually used; the PyTorch wing's part of the one logging switch
(:func:`xpuruntime.enable_dispatch_logging`, also ``xpuruntime.pytorch``'s).

Evidence, not the request: for attention, the aten op that ran (PyTorch dispatches
``F.scaled_dot_product_attention`` to one backend op per backend, forward and backward;
the math backend shows as ``_safe_softmax`` between two ``bmm``); for matmul and conv,
the library PyTorch's routing sends that op to under the switches in force (the GPU
tests check the matmul rule against cuBLASLt's own API log). Recording uses a
``TorchDispatchMode``, which sees every op: it is for opt-in logging only (see
``benchmarks/bench_policy_overhead.py`` for its cost), and torch.compile'd code runs
uncompiled while it records (TorchDynamo steps aside under a dispatch mode).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...kernels import DispatchRecord, add_dispatch_observer, dispatcher, registry
from .._kernels import register_kernels
from .._kernels._context import AttentionContext, dtype_name
from .._kernels._switches import _blas_library, flash_impl
from ._autocast import autocast_region
from ._policy import current_state
from ._ranges import ranges_active

__all__ = [
    "observed",
    "recording",
    "running",
]

aten = torch.ops.aten

# aten op -> (policy op, kernel name) for attention evidence.
_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention": "flash_v2",
    "_scaled_dot_product_flash_attention_backward": "flash_v2",
    "_scaled_dot_product_flash_attention_for_cpu": "flash_v2",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "flash_v2",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_efficient_attention_backward": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_cudnn_attention_backward": "cudnn",
    "_safe_softmax": "math",
}
_MATMUL_OPS = {"mm", "bmm", "addmm", "baddbmm"}
_CONV_OPS = {"convolution", "convolution_backward"}
# Norm ops -> (policy op, kernel). PyTorch's RMSNorm kernel op exists from torch 2.8;
# before that F.rms_norm is a composite of elementwise ops and leaves no single op.
_NORM_OPS = {
    "native_layer_norm": ("layernorm", "torch"),
    "native_layer_norm_backward": ("layernorm", "torch"),
    "_fused_rms_norm": ("rmsnorm", "torch"),
    "_fused_rms_norm_backward": ("rmsnorm", "torch"),
}
# Our own registered ops (namespace xpuruntime) -> (policy op, kernel).
_OUR_OPS = {
    "layer_norm": ("layernorm", "fused"),
    "layer_norm_backward": ("layernorm", "fused"),
    "rms_norm": ("rmsnorm", "fused"),
    "rms_norm_backward": ("rmsnorm", "fused"),
    "add_layer_norm": ("residual_layernorm", "fused"),
    "add_layer_norm_backward": ("residual_layernorm", "fused"),
    "add_rms_norm": ("residual_rmsnorm", "fused"),
    "add_rms_norm_backward": ("residual_rmsnorm", "fused"),
    "attention": ("attention", "triton"),
    "attention_backward": ("attention", "triton"),
    "linear_parameter_grads": ("linear", "fused"),
    # fused's GELU-gradient pass, which cublasLt's backward runs too.
    "gelu_backward": ("linear_gelu", ("fused", "cublasLt")),
    "gelu_aux_linear": ("linear_gelu", "cublasLt"),
    "gelu_mlp": ("mlp", "cublasLt"),
    "gelu_mlp_backward": ("mlp", "cublasLt"),
}

# The decision of the routed op running on this thread (set by :class:`running`), which
# the records of the ops it runs carry.
_in_flight = threading.local()


class running:
    """Mark ``decision`` as the one whose kernel runs in the block on this thread: the
    records of the ops it runs carry it (nested routed ops each mark their own)."""

    __slots__ = ("_decision", "_previous")

    def __init__(self, decision) -> None:
        self._decision = decision

    def __enter__(self) -> None:
        self._previous = getattr(_in_flight, "decision", None)
        _in_flight.decision = self._decision

    def __exit__(self, *exc: object) -> None:
        _in_flight.decision = self._previous


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[dict[str, Any], Any, Any]] = []
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "xpuruntime" and name in _OUR_OPS:
            op, name = _OUR_OPS[name][0], f"xpuruntime::{name}"
        elif name in _NORM_OPS:
            op = _NORM_OPS[name][0]
        elif name in _MATMUL_OPS:
            op = "matmul"
        elif name in _ATTENTION_OPS:
            op = "attention"
        elif name in _CONV_OPS:
            op = "conv"
        else:
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device
        cuda = device.type == "cuda"
        if cuda:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            out = func(*args, **kwargs)
            end.record()
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            begin, end = None, time.perf_counter() - t0
        fields = _describe(op, name, args, tensors, device)
        with self.lock:
            self.pending.append((fields, begin, end))
        return out

    def flush(self) -> None:
        """Turn pending records into DispatchRecords (waiting for their CUDA events)."""
        with self.lock:
            pending, self.pending = self.pending, []
        for fields, begin, end in pending:
            if begin is None:
                elapsed = end
            else:
                end.synchronize()
                elapsed = begin.elapsed_time(end) / 1e3
            dispatcher.log.append(DispatchRecord(**fields, elapsed_s=elapsed))


def _describe(op: str, name: str, args: tuple, tensors: list, device: torch.device) -> dict:
    state = current_state()
    policy = state.policy
    requested = policy.get(op) if policy is not None else None
    requested = None if requested == "auto" else requested
    backward = name.endswith("_backward") or torch._C._current_autograd_node() is not None
    context = {
        "aten_op": name,
        "phase": "backward" if backward else "forward",
        "shapes": [list(t.shape) for t in tensors],
        "dtype": dtype_name(tensors[0].dtype),
        "device": str(device),
        "precision": _precision(device, tensors[0].dtype),
    }
    decision = getattr(_in_flight, "decision", None)
    if decision is not None and decision.op != op:
        decision = None  # a routed op's kernel running another op (a matmul, say)
    if op in (
        "layernorm", "rmsnorm", "residual_layernorm", "residual_rmsnorm", "linear",
        "linear_gelu", "mlp",
    ):  # fmt: skip
        short = name.removeprefix("xpuruntime::")
        kernel = (_OUR_OPS if name != short else _NORM_OPS)[short][1]
        runs = kernel if isinstance(kernel, tuple) else (kernel,)  # the kernels it is part of
        kernel = runs[0] if decision is None or decision.chosen not in runs else decision.chosen
        context["evidence"] = f"op {name}"
        if decision is not None:
            source, requested, reason = decision.source, decision.requested, _reason(decision)
        else:
            source, reason = _judge(
                kernel if requested in runs else requested,
                kernel,
                lambda: "it cannot run this call (see the dispatcher's decision in this log)",
            )
            if source == "auto":
                reason = f"auto: {kernel} chosen for this call's shape class"
    elif op == "attention":
        short = name.removeprefix("xpuruntime::")
        kernel = _ATTENTION_OPS[name] if name == short else _OUR_OPS[short][1]
        if kernel == "flash_v2" and (flash_impl() or "").startswith("FA4"):
            kernel = "flash_v4"  # FA4 runs in PyTorch's FLASH backend
        context["evidence"] = f"aten op {name}"
        if decision is not None:
            source, requested, reason = decision.source, decision.requested, _reason(decision)
        else:
            source, reason = _judge(requested, kernel, lambda: _why_not(requested, args))
    elif op == "matmul":
        kernel, rule = _matmul_library(name, args, device)
        context["evidence"] = rule
        decision = state.decisions.get("matmul")
        if "bias epilogue" in rule:  # not governed by the matmul policy
            source, reason, requested = "auto", rule, None
        else:
            source, reason = _judge(requested, kernel, lambda: _rejection(decision, requested))
    else:
        kernel = _conv_library(tensors[0])
        context["evidence"] = "PyTorch's convolution routing under the cuDNN switches in force"
        decision = state.decisions.get("conv")
        source, reason = _judge(requested, kernel, lambda: _rejection(decision, requested))
    if decision is not None:
        context["via"] = f"the policy's {op} op (its decision for this call)"
    return {
        "op": op,
        "chosen": kernel,
        "source": source,
        "reason": reason,
        "requested": requested,
        "rejected": () if decision is None else decision.rejected,
        "context": context,
        "timestamp": time.time(),
    }


def _reason(decision) -> str:
    if decision.source == "fallback":
        why = _rejection(decision, decision.requested)
        return f"the policy asks for {decision.requested!r}, which cannot run this: {why}"
    return decision.reason


def _rejection(decision, name: str | None) -> str:
    if decision is None:
        return "no decision recorded"
    return dict(decision.rejected).get(name or "", decision.reason)


def _judge(requested: str | None, kernel: str, why_not) -> tuple[str, str]:
    if requested is None:
        return "auto", "PyTorch's own choice under the switches in force"
    if requested == kernel or requested == "default":
        return "policy", "the policy asks for it"
    return "fallback", f"the policy asks for {requested!r}, which did not run: {why_not()}"


def _why_not(requested: str, args: tuple) -> str:
    """PyTorch's own reason why the requested attention backend was not taken."""
    register_kernels()
    if len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
        return (
            "PyTorch took the math backend; its reason is not visible below the SDPA call "
            "(ops.fused_attention resolves each call through the dispatcher and says why)"
        )
    query, key, value = args[:3]
    mask = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
    ctx = AttentionContext(query, key, value, mask, 0.0, False, False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        support = registry.get("attention", requested).supports(ctx)
    return support.reason if not support.ok else "PyTorch preferred another backend"


def _matmul_library(name: str, args: tuple, device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "cpu_blas", f"{name} on {device}: the CPU BLAS"
    if name == "addmm" and args[0].dim() == 1 and _lt_epilogue(args):
        return "cublasLt", "addmm with a 1-D bias: PyTorch's cuBLASLt bias epilogue"
    library = "cublasLt" if _blas_library() == "cublaslt" else "cublas"
    return library, f"{name} with preferred_blas_library={library}"


def _lt_epilogue(args: tuple) -> bool:
    bias, mat1, mat2 = args[:3]
    # PyTorch's addmm takes the Lt epilogue path for a contiguous 1-D bias of length N
    # and fp32/fp16/bf16 operands bigger than 1 in every dimension.
    return (
        bias.is_contiguous()
        and bias.shape[0] == mat2.shape[1]
        and mat1.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and min(mat1.shape[0], mat1.shape[1], mat2.shape[1]) > 1
    )


def _conv_library(x: torch.Tensor) -> str:
    if x.device.type == "cuda" and torch.backends.cudnn.is_acceptable(x):
        if torch.backends.cudnn.benchmark:
            return "cudnn_benchmark"
        if torch.backends.cudnn.deterministic:
            return "cudnn_deterministic"
        return "cudnn"
    if x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "native"


def _precision(device: torch.device, dtype: torch.dtype) -> str:
    # Below PyTorch's autocast layer torch.is_autocast_enabled() reads False (autocast
    # excludes its own dispatch key while it runs an op), so xpt.autocast leaves a mark.
    region = autocast_region(device.type)
    if region is not None:
        return f"autocast {region}"
    return dtype_name(dtype)


_recorder: _Recorder | None = None
_recorder_lock = threading.Lock()


def recording() -> bool:
    """Whether dispatch logging is on (ops are being recorded)."""
    return _recorder is not None


def observed() -> bool:
    """Whether calls are observed: the dispatch log records, or ranges are kept (a
    profile, :class:`xpuruntime.Profiler`, NVTX). Routed ops then take their resolved
    path, with ranges and decisions."""
    return _recorder is not None or ranges_active()


class _OpRecording:
    """The PyTorch wing's part of the one logging switch
    (:func:`xpuruntime.enable_dispatch_logging`): a dispatch mode recording every op."""

    def start(self) -> None:
        global _recorder
        with _recorder_lock:
            if _recorder is None:
                _recorder = _Recorder()
                _recorder.__enter__()

    def stop(self) -> None:
        global _recorder
        with _recorder_lock:
            if _recorder is not None:
                _recorder.__exit__(None, None, None)
                _recorder.flush()
                _recorder = None

    def flush(self) -> None:
        if _recorder is not None:
            _recorder.flush()


add_dispatch_observer(_OpRecording())

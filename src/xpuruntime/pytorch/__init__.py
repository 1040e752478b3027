"""PyTorch training under an explicit kernel policy, with proof of the kernels that ran.

Optional: needs PyTorch (``pip install xpuruntime[torch]``), imported only when this
module is. A policy names a kernel per op. Two kinds of op:

- process-wide (``matmul``, ``conv``, and ``attention`` for direct
  ``F.scaled_dot_product_attention`` calls): applied once, when the policy is set,
  through PyTorch's own switches; nothing is added per call;
- routed per call (``attention`` in :func:`fused_attention`, ``layernorm``, ``rmsnorm``,
  ``residual_layernorm``, ``residual_rmsnorm``, ``linear``, ``linear_gelu``, ``mlp``,
  ``cross_entropy``, ``swiglu``, ``geglu``, ``rope``): each call signature is resolved once through the dispatcher (the
  policy's kernel, its fallback, or ``auto``), then the chosen kernel runs itself on
  every call with that signature until the policy changes. They run where the model
  calls them: through :func:`fused_attention`, the drop-in modules of :mod:`.nn`, and
  the forwards that :func:`optimize` rewrites or binds. Under ``best_performance``,
  ``auto`` times the candidates as they will run: as CUDA-graph replays (GPU time
  alone) while a graph is warmed up, as eager calls otherwise; an eager
  :class:`TrainStep` keeps whichever of the two rankings runs its whole step faster.

With logging on (:func:`enable_dispatch_logging`, the same switch as
``xpuruntime.enable_dispatch_logging``), every matmul, attention, convolution and
routed op that runs is recorded with the kernel it actually used and the decision
behind it.

Which PyTorch calls each choice governs
---------------------------------------
``matmul`` (CUDA): ``cublas`` / ``cublasLt`` set ``torch.backends.cuda.preferred_blas_library``,
which steers ``mm``, ``bmm``, ``baddbmm`` and ``addmm`` without a fused bias (so
``x @ w``, ``torch.matmul``, ``nn.Linear(bias=False)``). ``nn.Linear`` with a bias already
runs through cuBLASLt's bias epilogue whatever the preference; the log says so.
``default`` restores PyTorch's startup preference. On the CPU, matmuls run on the CPU
BLAS and the CUDA choices fall back (or raise, when strict).

``attention``: ``flash_v2``, ``flash_v4``, ``cudnn``, ``efficient`` and ``math`` are the
backends of ``F.scaled_dot_product_attention`` (``flash_v2`` is PyTorch's FLASH_ATTENTION
backend: FlashAttention-2 on CUDA, its C++ port on the CPU; ``flash_v4`` is the same
backend running FlashAttention-4 through ``torch.nn.attention.activate_flash_attention_impl``,
on Hopper and Blackwell GPUs with ``pip install 'xpuruntime[flash4]'``). For direct
``F.scaled_dot_product_attention`` calls the policy sets PyTorch's backend switches and
priority order (strict: only the named backend is enabled, so PyTorch itself refuses
what it cannot run; otherwise the named backend and then math, the one that runs
anything). :func:`fused_attention` (also ``ops.fused_attention``) resolves each call
signature through the dispatcher and raises :class:`~xpuruntime.UnsupportedOperationError`
with the reasons, or falls back with a warning; ``triton`` (our kernel) runs only there.

``conv``: ``cudnn_benchmark`` (cuDNN autotuning), ``cudnn_deterministic``, ``default``.

``layernorm`` / ``rmsnorm``: ``fused`` (our Triton kernels), ``torch``, ``auto``; they
govern :class:`nn.LayerNorm` / :class:`nn.RMSNorm`, which :func:`optimize` puts in place
of a model's norms.

``residual_layernorm``: ``fused`` (:func:`ops.fused_add_layernorm`: a residual add and
the layer norm of its sum in one kernel each way), ``torch`` (the add, then the norm as
``layernorm`` says), ``auto``; naming it has :func:`optimize` rewrite, with ``torch.fx``,
the forwards that compute ``norm(a + b)`` and use the sum again (pre-norm residual
streams).

``residual_rmsnorm``: ``fused`` (:func:`ops.fused_add_rmsnorm`), ``torch``, ``auto``; the
same for RMS norms, in transformers' decoder layers: unless the policy names ``torch``,
:func:`optimize` binds on each decoder layer whose forward computes ``h = residual + h;
residual = h; h = self.<norm>(h)`` (an RMSNorm) a copy of that forward with those
statements as this op.

``cross_entropy``: ``fused_linear`` (:func:`ops.fused_linear_cross_entropy`: the LM head
and its loss in chunks, the logits never materialised), ``torch``, ``auto``; it governs
the :class:`LinearCrossEntropyHead` that :func:`optimize` puts in place of a language
model's head, when its logits go to ``F.cross_entropy``.

``linear``: ``fused`` (:func:`ops.fused_linear`: the weight and bias gradients written in
the parameters' dtype by the GEMM and a Triton column sum, no cast kernels under
autocast), ``torch``, ``auto``; it governs :class:`nn.Linear`, which :func:`optimize`
puts in place of a model's ``nn.Linear`` layers when the policy names ``linear``.

``linear_gelu``: ``fused`` (:func:`ops.fused_linear_gelu`: GELU's backward and the bias
gradient in one pass before the linear layer's GEMMs), ``cublasLt`` (the same backward;
forward, one cuBLASLt GEMM whose GELU epilogue writes GELU's input and output, through
nvmath-python; tanh GELU, bf16/fp16, CUDA), ``torch`` (the linear layer, as ``linear``
says, then GELU), ``auto``; naming it has :func:`optimize` rewrite, with ``torch.fx``, the
forwards that feed a linear layer's output to an ``nn.GELU`` alone; and unless the policy
names ``torch``, :func:`optimize` binds on modules whose forward computes ``h =
self.<layer>(h); h = self.<act>(h)`` with a linear layer (or transformers' ``Conv1D``) and
a GELU module (``NewGELUActivation`` and the like, recognised by probe) a copy of that
forward running the pair as this op (GPT-2's MLP).

``mlp``: ``cublasLt`` (:func:`ops.fused_mlp`: a linear layer, GELU and a linear layer
with GELU in the first GEMM's epilogue and its derivative in the epilogue of the second
layer's input-gradient GEMM; tanh GELU, bf16/fp16, CUDA, nvmath-python), ``torch`` (the
layers as written, the first with its GELU as ``linear_gelu`` says), ``auto``; naming it
has :func:`optimize` rewrite the forwards where the two layers and the GELU between them
have no other user, before ``linear_gelu`` takes the pairs left. (``cublaslt``, the
former spelling, is accepted.)

Whole training steps: :func:`make_train_step` builds a step from one policy (kernels,
``precision``, ``cuda_graph``); :func:`make_graphed_train_step`, :class:`CUDAGraphWrapper`
and :func:`capture_graph` capture CUDA graphs and name the op when capture is broken;
:func:`set_allocator`, :func:`allocator_stats` and :func:`memory_pool` control PyTorch's
CUDA allocator.

Threads: PyTorch's switches are process-wide, so is the policy: setting it in one
thread changes it for all. Dispatch logging records the ops of the thread that turned it
on (and the backward passes it starts), because PyTorch's dispatch modes are per thread.
"""

from __future__ import annotations

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "xpuruntime.pytorch requires PyTorch. Install with: pip install xpuruntime[torch]"
    ) from e

from .._errors import BackendUnavailableError

_MINIMUM = (2, 4)
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < _MINIMUM:
    raise BackendUnavailableError(
        f"xpuruntime.pytorch needs torch >= {'.'.join(map(str, _MINIMUM))}, "
        f"found {torch.__version__}; upgrade with: pip install -U 'torch>=2.4'"
    )

from ..kernels import (  # noqa: E402  (the one logging switch; ._logging adds torch's ops)
    clear_dispatch_logs,
    disable_dispatch_logging,
    enable_dispatch_logging,
    export_dispatch_logs,
    get_dispatch_logs,
)
from . import (  # noqa: E402  (nn: not in __all__, so that `import *` keeps torch's)
    distributed,
    nn,
    ops,
)
from ._functional._attention import fused_attention  # noqa: E402
from ._functional._lm_head import DeferredLogits, LinearCrossEntropyHead  # noqa: E402
from ._optimize._apply import OptimizationReport, optimize  # noqa: E402
from ._selection import _logging  # noqa: E402, F401  (records PyTorch's ops while the log is on)
from ._selection._autocast import autocast  # noqa: E402
from ._selection._policy import (  # noqa: E402
    clear_kernel_policy,
    explain_kernel_policy,
    freeze_kernel_policy,
    get_kernel_policy,
    kernel_policy,
    set_kernel_policy,
)
from ._selection._profile import profile  # noqa: E402
from ._training._allocator import (  # noqa: E402
    AllocatorStats,
    allocator_stats,
    memory_pool,
    reset_allocator,
    set_allocator,
)
from ._training._graphs import CapturedGraph, CUDAGraphWrapper, GraphCapture, capture_graph  # noqa: E402
from ._training._train_step import (  # noqa: E402
    GraphedTrainStep,
    TrainStep,
    make_graphed_train_step,
    make_train_step,
)

# The policy-routed attention and the drop-in modules live above the ops/ floor; the seed
# documents' ``ops.fused_attention`` and the modules' former ``ops.Fused*`` names are
# set on that package here (see its docstring).
ops.fused_attention = fused_attention
ops.FusedLayerNorm, ops.FusedRMSNorm, ops.FusedLinear = nn.LayerNorm, nn.RMSNorm, nn.Linear

__all__ = [
    "AllocatorStats",
    "CUDAGraphWrapper",
    "CapturedGraph",
    "GraphCapture",
    "DeferredLogits",
    "GraphedTrainStep",
    "LinearCrossEntropyHead",
    "OptimizationReport",
    "TrainStep",
    "allocator_stats",
    "autocast",
    "capture_graph",
    "clear_dispatch_logs",
    "clear_kernel_policy",
    "disable_dispatch_logging",
    "enable_dispatch_logging",
    "explain_kernel_policy",
    "freeze_kernel_policy",
    "export_dispatch_logs",
    "fused_attention",
    "get_dispatch_logs",
    "get_kernel_policy",
    "kernel_policy",
    "make_graphed_train_step",
    "make_train_step",
    "memory_pool",
    "distributed",
    "ops",
    "optimize",
    "profile",
    "reset_allocator",
    "set_allocator",
    "set_kernel_policy",
]

"""PyTorch training under an explicit kernel policy, with proof of the kernels that ran.

Optional: needs PyTorch (``pip install xpuruntime[torch]``), imported only when this
module is. A policy names a kernel per op: process-wide ops (``matmul``, ``conv``, and
``attention`` for direct ``F.scaled_dot_product_attention`` calls) are set once through
PyTorch's own switches; the routed ops (the norms, ``linear``, ``swiglu``, ``rope``,
``cross_entropy``, ...) resolve each call signature once, then the chosen kernel runs
itself. :func:`optimize` rewrites a model onto them and reports what runs;
:func:`make_train_step` builds a whole training step from one policy. The policy is
process-wide, as PyTorch's switches are. The reference of every op and kernel is the
documentation's policy page (``docs/policy.md``).
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
    nn,  # noqa: F401  (xpt.nn; not in __all__)
    ops,
)
from ._functional._attention import fused_attention  # noqa: E402
from ._functional._lm_head import DeferredLogits, LinearCrossEntropyHead  # noqa: E402
from ._graphs.capture import CapturedGraph, CUDAGraphWrapper, GraphCapture, capture_graph  # noqa: E402
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
from ._training._train_step import (  # noqa: E402
    GraphedTrainStep,
    TrainStep,
    make_graphed_train_step,
    make_train_step,
)

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

"""Launch heuristics and checks shared by the Triton ops: where a kernel may run, the
block size and warp count for a row of ``n`` elements, how many programs fill the
device, and what the ops' drop-in modules share. One place, so that every op refuses
unsupported inputs with the same words."""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from ...._errors import BackendUnavailableError, InvalidInputError, UnsupportedOperationError
from ....kernels import FallbackWarning, dispatcher

__all__ = [
    "ADDMM_TO_FP32",
    "FLOAT_DTYPES",
    "MAX_ROW_BLOCK",
    "MM_TO_FP32",
    "autocast_dtype",
    "mm_as",
    "interpreting",
    "backward_launch",
    "cast",
    "cdiv",
    "check_matching_dtypes",
    "require_triton",
    "forward_rows",
    "row_groups",
    "row_launch",
    "rows_at_once",
    "sm_count",
    "through_registered_op",
    "triton_or_fallback",
    "triton_unavailable",
]

_dispatch_log = dispatcher.log  # while on, calls go through our registered torch ops

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

MAX_ROW_BLOCK = 16384
"""The widest row a norm kernel holds in registers; wider rows take the looped kernels."""

LOOP_BLOCK = 4096
"""The chunk the looped kernels walk a wide row in."""


# Read once: Triton itself fixes interpretation when a kernel is defined, and the answers
# must be constants to torch.compile, which traces the checks below.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def through_registered_op() -> bool:
    """Whether a call must go through our registered torch op rather than the
    equivalent autograd.Function: torch.compile needs the op (and its fake
    implementation), and the dispatch log sees only ops. Otherwise the Function runs the
    same kernels for about a tenth of the op's host cost (measured: ~0.5 ms per
    layer-norm forward+backward through torch.library on the H200 host)."""
    return _dispatch_log.enabled or torch.compiler.is_compiling()


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, which
    must be set before xpuruntime.pytorch is imported)."""
    return _INTERPRET


def triton_unavailable(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on ``device``, or None when it can."""
    if not _TRITON_INSTALLED:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda" or (device.type == "cpu" and _INTERPRET):
        return None
    if device.type == "cpu":
        return "Triton kernels run on CUDA devices (on the CPU only under TRITON_INTERPRET=1)"
    return f"Triton kernels run on CUDA devices, not {device}"


def triton_or_fallback(op: str, *tensors: torch.Tensor) -> bool:
    """Whether ``op``'s Triton kernels can take ``tensors``; when they cannot (a CPU
    without ``TRITON_INTERPRET=1``, no Triton), the caller runs PyTorch's own op
    instead, after a ``FallbackWarning`` (the seed documents' behaviour), unless the
    kernel policy is strict, which raises as :func:`require_triton` does."""
    why = triton_unavailable(tensors[0].device)
    if why is None:
        require_triton(op, *tensors)  # the tensors' devices must still agree
        return True
    if dispatcher.strict:  # the kernel policy in force is strict
        require_triton(op, *tensors)
    warnings.warn(
        f"{op}: {why}; running PyTorch's own op instead (strict=True makes this an error)",
        FallbackWarning,
        stacklevel=3,
    )
    return False


def require_triton(op: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error unless ``op``'s Triton kernels can take ``tensors``."""
    device = tensors[0].device
    why = triton_unavailable(device)
    if why is not None:
        error = BackendUnavailableError if "not installed" in why else UnsupportedOperationError
        raise error(f"{op}: {why}")
    for t in tensors[1:]:
        if t.device != device:
            raise InvalidInputError(
                f"{op}: every tensor must be on {device}, got one on {t.device}"
            )


def check_matching_dtypes(op: str, input: torch.Tensor, weight: torch.Tensor) -> None:
    """Outside autocast, a projection's input and weight must share a dtype (as for
    ``F.linear``); under autocast both are cast to the autocast dtype."""
    if not torch.is_autocast_enabled(input.device.type) and input.dtype != weight.dtype:
        raise InvalidInputError(
            f"{op}: input is {input.dtype} and weight {weight.dtype}; outside autocast "
            "they must match"
        )


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it is already. A ``.to`` that has nothing to
    do still costs ~1-3 µs of host time, several per call of a small op."""
    return t if t.dtype == dtype else t.to(dtype)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ops run in under autocast on ``device_type``, or None when autocast is
    off there."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def row_launch(n: int, element_size: int) -> tuple[int, int, bool]:
    """(BLOCK_N, num_warps, looped) for a forward over rows of ``n`` elements of
    ``element_size`` bytes.

    Rows up to :data:`MAX_ROW_BLOCK` elements are held in registers in one block; wider
    rows are walked in :data:`LOOP_BLOCK` chunks. One warp per KiB of row, 1 to 8: on an
    H200 (bf16, ``benchmarks/tune_norms.py``) this reaches 95% of the copy bandwidth from
    1024 to 16384 wide, where 16 warps lose up to 20%.
    """
    if n < 1:
        raise InvalidInputError(f"the normalized size must be at least 1, got {n}")
    looped = n > MAX_ROW_BLOCK
    block = LOOP_BLOCK if looped else max(16, 1 << (n - 1).bit_length())
    return block, _clamp(block * element_size // 1024, 1, 8), looped


def backward_launch(block: int, element_size: int) -> tuple[int, int]:
    """(num_warps, programs per SM) for a persistent backward over rows of ``block``.

    Narrow rows want many small programs per SM to keep loads in flight across the rows
    each program walks; wide rows want one wide program (H200, bf16, tune_norms.py).
    """
    row_bytes = block * element_size
    return _clamp(row_bytes // 1024, 4, 16), _clamp(16384 // row_bytes, 1, 8)


def rows_at_once(block: int) -> int:
    """Rows a persistent backward takes in one step over rows of ``block``: 32 for rows of
    up to 256 (a head's 128: Qwen3's and Gemma3's per-head q/k norms), which would
    otherwise wait on each row's loads in turn; one for wider rows. H200, bf16 RMSNorm
    backward over 2^27 elements (rows at once 1 / 32): width 64 1.35 / 0.30 ms, 128 0.74 /
    0.28, 256 0.43 / 0.32; from 512 up one row is as fast or faster (32 rows of 512
    spill)."""
    return 32 if block <= 256 else 1


def forward_rows(block: int, warps: int) -> tuple[int, int]:
    """(rows a forward program takes, num_warps) over rows of ``block``, ``warps`` being
    :func:`row_launch`'s: eight rows on two warps for rows of up to 256 (a q/k norm's
    heads), which one warp a row leaves waiting on their loads."""
    # H200, bf16, 8192 tokens' heads read in place (tune_norms.py --heads), GB/s one row
    # a warp / 8 rows on 2 warps: 16 heads of 128 1203 / 3284, 8 of 128 1121 / 2924,
    # 4 of 256 1976 / 2844, 32 of 64 618 / 3343.
    return (8, 2) if block <= 256 else (1, warps)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints, on the host. ``triton.cdiv`` is a Triton
    constexpr function: called from Python it costs ~3 µs, a launch's worth of host time
    for a small op that computes a few grids."""
    return -(-a // b)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def row_groups(device: torch.device, rows: int, per_sm: int = 2) -> tuple[int, int]:
    """(programs, rows per program) for a persistent kernel walking ``rows`` rows:
    enough programs to fill the device, none of them left without a row."""
    if device.type != "cuda":
        programs = max(1, min(rows, 4))
    else:
        programs = max(1, min(rows, per_sm * _sm_count(device.index or 0)))
    per_program = cdiv(rows, programs)
    return cdiv(rows, per_program), per_program


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return _sm_count(device.index or 0)


# torch >= 2.8 has CUDA GEMMs from bf16/fp16 inputs to an fp32 output (``mm.dtype``),
# and ones that add such a product into an fp32 matrix in their epilogue (``addmm.dtype``).
MM_TO_FP32 = "dtype" in torch.ops.aten.mm.overloads()
ADDMM_TO_FP32 = "dtype_out" in torch.ops.aten.addmm.overloads()


def mm_as(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` written in ``out_dtype`` (fp32 from bf16/fp16 inputs straight from the
    GEMM's accumulator where PyTorch can), into ``out`` when given (a gradient's target,
    :mod:`._grad_targets`)."""
    if a.dtype == out_dtype:
        return torch.mm(a, b, out=out)
    if out_dtype == torch.float32 and a.is_cuda and MM_TO_FP32:
        return torch.mm(a, b, out_dtype=out_dtype, out=out)
    product = torch.mm(a, b)
    return product.to(out_dtype) if out is None else out.copy_(product)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count

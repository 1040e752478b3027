"""cuBLASLt GEMMs with GELU epilogues, through NVIDIA's bindings (``nvmath-python``'s
``nvmath.bindings.cublasLt``).

PyTorch runs ``F.linear`` through cuBLASLt with its bias epilogue, but exposes none of
the GELU epilogues. Here one GEMM with ``CUBLASLT_EPILOGUE_GELU_AUX_BIAS`` writes both
GELU's input (the "aux" matrix, which the backward needs) and its output, where
``F.linear`` then ``F.gelu`` write the input and read it back. cuBLASLt's GELU is the
tanh approximation.

The backward of a whole MLP (:func:`..fused_mlp`) puts GELU's derivative in the
``DGELU`` epilogue of the second layer's input-gradient GEMM, which reads the saved
GELU input as its aux matrix.

Measured on an H100 (16384 x 768 -> 3072, bf16): GELU_AUX_BIAS 161 µs against 187 µs for
F.linear then F.gelu; DGELU 153-173 µs against 124 µs for the plain GEMM plus 119 µs for
our Triton GELU-gradient pass. ``DGELU_BGRAD`` (the bias gradient in the epilogue too)
took 470 µs in every algorithm offered, so the bias gradient stays a column sum.

A plan (descriptors, layouts and the heuristic's algorithm) is made once per shape,
dtype and operand alignment, and reused; a call sets the bias and aux pointers and
launches on the current stream, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import Tensor

from ...._errors import BackendUnavailableError, UnsupportedOperationError

__all__ = ["dgelu_matmul", "gelu_aux_linear", "refusal", "require", "unavailable"]

_WORKSPACE_BYTES = 32 << 20  # what PyTorch gives cuBLAS(Lt) on Hopper
_CUDA_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # cudaDataType_t
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1
_lock = threading.Lock()
_plans: dict[tuple, _Plan] = {}
_workspaces: dict[tuple[int, int], Tensor] = {}


@functools.cache
def unavailable() -> str | None:
    """Why the cuBLASLt epilogues cannot run in this process (None when they can), as a
    predicate ("needs ...") for a subject naming what was asked."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError:
        return (
            "needs nvmath-python (NVIDIA's bindings to cuBLASLt); install it with "
            "pip install xpuruntime[cublaslt]"
        )
    try:
        version = cublasLt.get_version()
    except Exception as e:  # the library itself could not be loaded
        return f"cannot run: nvmath-python could not load the cuBLASLt library ({e})"
    if version < 11_000:  # GELU_AUX_BIAS from cuBLASLt 11.x
        return f"needs cuBLASLt 11.0 or newer for GELU_AUX_BIAS; this is {version}"
    return None


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    in_features: int,
    out_features: int,
    approximate: str | None,
) -> str | None:
    """Why the GELU-epilogue GEMM cannot run a layer (None when it can); whether the
    library is there is :func:`unavailable`'s question."""
    if device.type != "cuda":
        return f"cuBLASLt runs on CUDA devices; this is {device}"
    if dtype not in _CUDA_DTYPES:
        return f"cuBLASLt's GELU epilogue runs in bf16 or fp16 (as under autocast), not {dtype}"
    if approximate != "tanh":
        return (
            "cuBLASLt's GELU epilogue is the tanh approximation; this GELU is "
            f"approximate={approximate!r}"
        )
    if in_features % 8 or out_features % 8:
        return (
            "cuBLASLt's GELU epilogue needs in_features and out_features that are multiples "
            f"of 8 (16-byte rows), got {in_features} and {out_features}"
        )
    return None


def require(op: str, refused: str | None = None) -> None:
    """Raise what keeps ``op`` from the epilogues: the library's absence
    (:class:`BackendUnavailableError`; not asked inside a torch.compile trace, which cannot
    call into nvmath: the op asks when it runs), else ``refused``
    (:class:`UnsupportedOperationError`)."""
    missing = None if torch.compiler.is_compiling() else unavailable()
    if missing is not None:
        raise BackendUnavailableError(f"{op} {missing}")
    if refused is not None:
        raise UnsupportedOperationError(f"{op}: {refused}")


def gelu_aux_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(gelu(x @ weight.T + bias), x @ weight.T + bias)`` (GELU in its tanh form) from
    one cuBLASLt GEMM, for 2-D ``x`` (M, K), ``weight`` (N, K) and ``bias`` (N,), all
    contiguous CUDA tensors of one dtype (bf16 or fp16) with K and N multiples of 8.

    Raises
    ------
    BackendUnavailableError
        nvmath-python or its cuBLASLt library is missing.
    """
    out = torch.empty((x.shape[0], weight.shape[0]), device=x.device, dtype=x.dtype)
    pre = torch.empty_like(out)
    _gemm("gelu_aux", weight, True, x, out, bias, pre)
    return out, pre


def dgelu_matmul(grad: Tensor, weight: Tensor, pre: Tensor) -> Tensor:
    """``(grad @ weight) * GELU'(pre)`` (tanh form) from one cuBLASLt GEMM with the DGELU
    epilogue, for ``grad`` (M, C), ``weight`` (C, N) and ``pre`` (M, N), as
    :func:`gelu_aux_linear` asks of its operands: GELU's input gradient from the output
    gradient of the linear layer after it (``weight`` is that layer's)."""
    out = torch.empty_like(pre)
    _gemm("dgelu", weight, False, grad, out, None, pre)
    return out


def _gemm(kind, a, a_transposed, b, out, bias, aux) -> None:
    """``out`` (M, N) = ``b`` (M, K) @ ``a`` (N, K if ``a_transposed``, else K, N) through
    the ``kind`` epilogue, row-major throughout."""
    require("cuBLASLt's GELU epilogue")
    device = b.device
    if torch.cuda.current_device() != device.index:
        with torch.cuda.device(device):  # cuBLASLt launches on the current device
            return _gemm(kind, a, a_transposed, b, out, bias, aux)
    m, k = b.shape
    if m == 0:
        return None
    n = out.shape[1]
    key = (kind, device.index, b.dtype, m, n, k, a_transposed, bias is not None)
    key += (_alignment(a), _alignment(b))
    plan = _plans.get(key)
    if plan is None:
        with _lock, torch.cuda.device(device):
            plan = _plans.get(key) or _plans.setdefault(key, _Plan(*key))
    stream = torch.cuda.current_stream(device).cuda_stream
    plan.run(a, b, out, bias, aux, _workspace(device, stream), stream)
    return None


def _alignment(t: Tensor) -> int:
    """The largest power of two up to 256 that divides the tensor's address (what the
    heuristic must be told when an operand is less aligned than its default of 256)."""
    address = t.data_ptr()
    return min(256, address & -address) if address else 256


def _workspace(device: torch.device, stream: int) -> Tensor:
    """One workspace per device and stream (as PyTorch keeps for cuBLAS)."""
    key = (device.index, stream)
    space = _workspaces.get(key)
    if space is None:
        space = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[key] = space
    return space


class _Plan:
    """One GEMM shape's cuBLASLt descriptors and algorithm.

    cuBLASLt is column-major: row-major ``out`` (M, N) is column-major (N, M), computed as
    ``out^T = a^T · b^T`` with ``b`` (M, K) read as stored (column-major (K, M)) and ``a``
    read transposed when it is (N, K) (column-major (K, N)), as stored when (K, N).
    The epilogue's aux matrix (GELU's input) is laid out as ``out``."""

    def __init__(
        self, kind, device, dtype, m, n, k, a_transposed, has_bias, align_a, align_b
    ) -> None:
        import numpy as np
        from nvmath.bindings import cublas
        from nvmath.bindings import cublasLt as lt

        self._lt, attr = lt, lt.MatmulDescAttribute
        code = _CUDA_DTYPES[dtype]
        if kind == "dgelu":
            epilogue = lt.Epilogue.DGELU
        else:
            epilogue = lt.Epilogue.GELU_AUX_BIAS if has_bias else lt.Epilogue.GELU_AUX
        self._handle = lt.create()
        self._desc = lt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, _CUDA_R_32F)
        for name, value in (
            (attr.TRANSA, _OP_T if a_transposed else _OP_N),
            (attr.TRANSB, _OP_N),
            (attr.EPILOGUE, epilogue),
            (attr.EPILOGUE_AUX_LD, n),
            *([(attr.BIAS_DATA_TYPE, code)] if has_bias else []),
        ):
            value = np.array(value, dtype=lt.get_matmul_desc_attribute_dtype(name))
            lt.matmul_desc_set_attribute(self._desc, name, value.ctypes.data, value.itemsize)
        self._a = lt.matrix_layout_create(code, *((k, n, k) if a_transposed else (n, k, n)))
        self._b = lt.matrix_layout_create(code, k, m, k)
        self._d = lt.matrix_layout_create(code, n, m, n)
        pref = lt.matmul_preference_create()
        pattr = lt.MatmulPreferenceAttribute
        for name, value in (
            (pattr.MAX_WORKSPACE_BYTES, _WORKSPACE_BYTES),
            (pattr.MIN_ALIGNMENT_A_BYTES, align_a),
            (pattr.MIN_ALIGNMENT_B_BYTES, align_b),
        ):
            value = np.array(value, dtype=lt.get_matmul_preference_attribute_dtype(name))
            lt.matmul_preference_set_attribute(pref, name, value.ctypes.data, value.itemsize)
        self._results = lt.MatmulHeuristicResult(1)
        found = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(
                self._handle, self._desc, self._a, self._b, self._d, self._d, pref, 1,
                self._results.ptr, found.ctypes.data,
            )  # fmt: skip
        finally:
            lt.matmul_preference_destroy(pref)
        if found[0] < 1:
            raise RuntimeError(f"cuBLASLt offers no {kind} algorithm for a {m}x{k}x{n} GEMM")
        self._algo = self._results[0]["algo"].ctypes.data
        # alpha = 1, beta = 0 (fp32 scale), and the two pointers set per call.
        # (Addresses read once: each ndarray.ctypes access builds an object.)
        self._scalars = np.array([1.0, 0.0], dtype=np.float32)
        self._alpha, self._beta = self._scalars.ctypes.data, self._scalars.ctypes.data + 4
        self._pointers = np.zeros(2, dtype=np.uint64)
        self._pointer_address = self._pointers.ctypes.data
        self._pointer_attrs = (attr.BIAS_POINTER, attr.EPILOGUE_AUX_POINTER)
        self._lock = threading.Lock()

    def run(self, a, b, out, bias, aux, workspace, stream) -> None:
        lt, address = self._lt, self._pointer_address
        with self._lock:  # the descriptor's pointers are set per call
            self._pointers[0] = 0 if bias is None else bias.data_ptr()
            self._pointers[1] = aux.data_ptr()
            if bias is not None:
                lt.matmul_desc_set_attribute(self._desc, self._pointer_attrs[0], address, 8)
            lt.matmul_desc_set_attribute(self._desc, self._pointer_attrs[1], address + 8, 8)
            lt.matmul(
                self._handle, self._desc, self._alpha, a.data_ptr(), self._a, b.data_ptr(),
                self._b, self._beta, out.data_ptr(), self._d, out.data_ptr(), self._d,
                self._algo, workspace.data_ptr(), workspace.numel(), stream,
            )  # fmt: skip

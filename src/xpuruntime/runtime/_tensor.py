"""Tensor: memory xpuruntime reads and hands on without copying, on the host or a GPU.

The seed API's zero-copy tensor (03_python_binding §3.2). A host tensor is a view of a
numpy array; a device tensor describes a CUDA tensor of PyTorch, CuPy or any DLPack /
``__cuda_array_interface__`` producer (shape, dtype, device, address and the stream its
pending work is on) and keeps the producer alive. Either speaks DLPack, so
``torch.from_dlpack(t)`` and ``np.from_dlpack(t)`` take it without a copy, and an
``InferenceSession`` takes it as an input.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._errors import InvalidInputError

__all__ = ["Tensor", "describe_device_tensor", "host_array"]

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_KINDS = (2, 13)  # kDLCUDA, kDLCUDAManaged


class Tensor:
    """A host or device tensor, described without copying its memory.

    Use :meth:`from_numpy` or :meth:`from_dlpack`.

    Examples
    --------
    >>> import numpy as np, xpuruntime as xrt
    >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> t = xrt.Tensor.from_numpy(a)
    >>> t.shape, t.device_id, t.data_ptr == a.ctypes.data
    ((2, 3), -1, True)
    >>> np.from_dlpack(t).base is not None
    True
    """

    __slots__ = ("device_index", "dtype", "ptr", "shape", "source", "stream")

    def __init__(
        self,
        source: Any,
        shape: tuple[int, ...],
        dtype: np.dtype,
        device_index: int | None,
        ptr: int | None = None,
        stream: int | None = None,
    ) -> None:
        # ``source`` is held for the memory's lifetime: a numpy array for a host tensor,
        # the producer's object for a device one. ``ptr`` is a device address that may
        # be bound directly, which needs the producer's ``stream`` (a raw handle; 0 and
        # 1 are the legacy default stream); without one, DLPack's ``stream`` argument
        # orders the work instead and ``ptr`` stays None.
        self.source, self.shape, self.dtype, self.device_index = source, shape, dtype, device_index
        self.ptr, self.stream = ptr, stream

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        """A view of ``array`` (no copy; the array is kept alive)."""
        if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray):
            raise InvalidInputError(
                f"Tensor.from_numpy: expected a numpy array, got {type(array).__name__}"
            )
        return cls(array, tuple(array.shape), array.dtype, None, array.ctypes.data)

    @classmethod
    def from_dlpack(cls, obj: Any) -> Tensor:
        """A tensor over any DLPack producer's memory (PyTorch CPU or CUDA, CuPy, numpy,
        JAX), without a copy.

        Raises
        ------
        InvalidInputError
            ``obj`` is not a DLPack producer, or lives on a device other than the host
            or a CUDA GPU.
        """
        if isinstance(obj, Tensor):
            return obj
        if isinstance(obj, np.ndarray):
            return cls.from_numpy(obj)
        if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
            raise InvalidInputError(
                f"Tensor.from_dlpack: {type(obj).__name__} is not a DLPack producer "
                "(no __dlpack__ / __dlpack_device__)"
            )
        kind = int(obj.__dlpack_device__()[0])
        if kind == _DLPACK_CPU:
            return cls.from_numpy(host_array("tensor", obj))
        described = describe_device_tensor("tensor", obj)
        if described is None:
            raise InvalidInputError(
                f"Tensor.from_dlpack: DLPack device type {kind} is neither the host nor a CUDA GPU"
            )
        return described

    # -- queries ---------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes between consecutive elements along each axis (numpy's convention)."""
        if self.device_index is None:
            return tuple(self.source.strides)
        return _c_strides(self.shape, self.dtype.itemsize)  # device tensors are C-contiguous

    @property
    def device_id(self) -> int:
        """The CUDA device index, or -1 for host memory."""
        return -1 if self.device_index is None else self.device_index

    @property
    def data_ptr(self) -> int:
        """The address of the first element (host or device)."""
        if self.ptr is not None:
            return self.ptr
        source = self.source
        for read in (
            lambda: source.data_ptr(),  # PyTorch
            lambda: source.__cuda_array_interface__["data"][0],  # CuPy, Numba
        ):
            try:
                return int(read())
            except Exception:
                continue
        raise InvalidInputError(
            f"this {type(source).__name__} does not say its device address; pass it to "
            "torch.from_dlpack instead"
        )

    # -- conversion ------------------------------------------------------------------------
    def to_numpy(self) -> np.ndarray:
        """The host tensor as a numpy array (the same memory).

        Raises
        ------
        InvalidInputError
            For a device tensor: copy it to the host first, e.g.
            ``torch.from_dlpack(t).cpu().numpy()``.
        """
        if self.device_index is not None:
            raise InvalidInputError(
                f"this tensor is on cuda:{self.device_index}; to_numpy() reads host memory "
                "only. Copy it first, e.g. torch.from_dlpack(t).cpu().numpy() or "
                "cupy.asnumpy(cupy.from_dlpack(t))"
            )
        return self.source

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the tensor (a consumer takes it once)."""
        return self.__dlpack__()

    def __dlpack__(self, *, stream: Any = None, **options: Any) -> Any:
        kwargs = {k: v for k, v in options.items() if v is not None}
        if stream is not None:
            kwargs["stream"] = stream
        return self.source.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device_index is None:
            return (_DLPACK_CPU, 0)
        return (_DLPACK_CUDA, self.device_index)

    def __repr__(self) -> str:
        where = "host" if self.device_index is None else f"cuda:{self.device_index}"
        return f"<Tensor {self.shape} {self.dtype} on {where}>"


def describe_device_tensor(name: str, value: Any) -> Tensor | None:
    """Describe ``value`` if it is a CUDA tensor; None for host data.

    Raises
    ------
    InvalidInputError
        For a CUDA tensor that is not C-contiguous or whose dtype has no numpy name.
    """
    if isinstance(value, Tensor):
        return value if value.device_index is not None else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _torch_tensor(name, value, torch)
    location = None
    if hasattr(value, "__dlpack_device__"):
        try:
            location = value.__dlpack_device__()
        except Exception:  # a producer that cannot say is treated as host data
            return None
        if int(location[0]) not in _DLPACK_CUDA_KINDS:
            return None
    cai = None
    try:
        cai = getattr(value, "__cuda_array_interface__", None)
    except Exception:  # a producer may raise for dtypes CAI cannot express
        cai = None
    if cai is None and location is None:
        return None
    index = None if location is None else int(location[1])
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
            raise InvalidInputError(
                f"input {name!r}: the CUDA tensor is not C-contiguous (strides {tuple(strides)}); "
                "pass a contiguous one (e.g. tensor.contiguous())"
            )
        # CAI version 3 names the producer's stream; without it the pointer is bound
        # directly only when there is no DLPack to order the work through.
        stream = cai.get("stream") if cai.get("version", 0) >= 3 else None
        if stream is not None or not hasattr(value, "__dlpack__"):
            return Tensor(value, shape, dtype, index, int(cai["data"][0]), stream)
        return Tensor(value, shape, dtype, index)
    try:
        dtype = np.dtype(str(value.dtype).rsplit(".", 1)[-1])
        shape = tuple(int(d) for d in value.shape)
    except (AttributeError, TypeError) as e:
        raise InvalidInputError(
            f"input {name!r}: cannot tell the dtype and shape of this {type(value).__name__} "
            f"on the GPU ({e})"
        ) from e
    contiguous = getattr(value, "is_contiguous", None)
    if callable(contiguous) and not contiguous():
        raise InvalidInputError(
            f"input {name!r}: the CUDA tensor is not contiguous; pass tensor.contiguous()"
        )
    return Tensor(value, shape, dtype, index)


def _torch_tensor(name: str, value: Any, torch: Any) -> Tensor | None:
    """A PyTorch tensor, read from its attributes (its ``__cuda_array_interface__`` costs
    several microseconds). Its pending work is on PyTorch's current stream."""
    if not value.is_cuda:
        return None
    dtype = _numpy_dtype(value.dtype)
    if dtype is None:
        raise InvalidInputError(
            f"input {name!r}: {value.dtype} has no numpy equivalent; convert the tensor "
            "to the model's input dtype"
        )
    if not value.is_contiguous():
        raise InvalidInputError(
            f"input {name!r}: the CUDA tensor is not contiguous; pass tensor.contiguous()"
        )
    index = value.device.index
    return Tensor(
        value, tuple(value.shape), dtype, index, value.data_ptr(), _current_stream(torch, index)
    )


_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _numpy_dtype(dtype: Any) -> np.dtype | None:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        try:
            found = np.dtype(str(dtype).rsplit(".", 1)[-1])  # torch.float32 -> float32
        except TypeError:  # bfloat16 and the float8 types have no numpy dtype
            return None
        _TORCH_DTYPES[dtype] = found
    return found


def _current_stream(torch: Any, index: int) -> int:
    global _raw_stream
    if _raw_stream is None:  # looked up once: ~0.3 µs a call against ~4 µs
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda i: torch.cuda.current_stream(i).cuda_stream
        )
    return int(_raw_stream(index))


_raw_stream: Any = None


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def host_array(name: str, value: Any) -> np.ndarray:
    """The numpy array over a host DLPack producer's memory (no copy where the dtype
    allows; bfloat16/float8 CPU torch tensors come back as ml_dtypes arrays).

    Raises
    ------
    InvalidInputError
        The producer cannot export host memory (a device tensor, an unsupported dtype).
    """
    if isinstance(value, Tensor) and value.device_index is None:
        return value.source
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and str(value.dtype).startswith(("torch.bfloat16", "torch.float8"))
    ):
        return _torch_exotic(name, value, torch)
    try:
        return np.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        raise InvalidInputError(
            f"input {name!r}: cannot read this {type(value).__name__} through DLPack "
            f"as host memory ({e}); pass a CPU tensor (e.g. tensor.detach().cpu())"
        ) from e


def _torch_exotic(name: str, value: Any, torch: Any) -> np.ndarray:
    """A CPU torch tensor of bfloat16 or a float8 type, as the ml_dtypes array it holds
    (numpy's DLPack reader refuses these types); no copy for a contiguous tensor."""
    import ml_dtypes

    kind = str(value.dtype).rsplit(".", 1)[-1]
    target = getattr(ml_dtypes, kind, None)
    if target is None or value.device.type != "cpu":
        raise InvalidInputError(
            f"input {name!r}: a {value.device.type} tensor of {value.dtype} cannot be read on "
            "the host; pass a CPU tensor of the model's input dtype"
        )
    carrier = torch.int16 if value.element_size() == 2 else torch.uint8
    return value.detach().contiguous().view(carrier).numpy().view(target)

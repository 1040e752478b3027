"""ONNX Runtime on a CUDA device: zero-copy I/O binding and CUDA-graph replay.

Device inputs (PyTorch, CuPy, any DLPack or ``__cuda_array_interface__`` producer) are
bound where they lie; the session's work runs on an xpuruntime :class:`Stream` given to
ONNX Runtime as its compute stream, and that stream first waits for the producer's
pending work (the DLPack ``stream`` argument, the CAI ``stream`` key), so no host copy
and no device-wide synchronisation happens. ORT's ``run`` returns once the outputs are
ready.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._errors import InvalidInputError, UnsupportedOperationError
from ..runtime import Stream
from ..runtime._tensor import Tensor

__all__ = ["CudaGraphRunner", "bind_device_input", "device_ortvalue"]


class _OrderedExport:
    """A producer's DLPack export, ordered before work queued on ``stream``."""

    __slots__ = ("_source", "_stream", "dtype")

    def __init__(self, source: Any, stream: Stream) -> None:
        self._source, self._stream = source, stream
        self.dtype = getattr(source, "dtype", None)  # ORT reads it to tell bool from uint8

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._source.__dlpack__(stream=self._stream.handle)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._source.__dlpack_device__()


def device_ortvalue(ort: Any, name: str, tensor: Tensor, stream: Stream) -> Any:
    """What to bind for ``tensor`` (no copy), after ``stream`` waits for its producer.

    A raw pointer is the cheapest to bind; it is used when the producer's stream is
    known (see :class:`Tensor`). A blocking session stream already waits for the
    legacy default stream (where PyTorch queues its work unless told otherwise), so no
    event is needed then. Otherwise DLPack orders the work through its ``stream``
    argument.
    """
    _check_device(name, tensor, stream)
    if tensor.ptr is not None:
        pending = tensor.stream
        if pending is not None and not (pending in _LEGACY and stream.blocking):
            stream.wait_for(pending)
        # The caller keeps ``source`` alive for the run; ORT only borrows the pointer.
        return _RawDevice(tensor)
    return ort.OrtValue.from_dlpack(_OrderedExport(tensor.source, stream))


_LEGACY = (0, 1)  # the NULL stream and CU_STREAM_LEGACY: the legacy default stream


class _RawDevice:
    """A pointer, shape and dtype for ``bind_input``."""

    __slots__ = ("dtype", "ptr", "shape")

    def __init__(self, tensor: Tensor) -> None:
        self.ptr, self.shape, self.dtype = tensor.ptr, tensor.shape, tensor.dtype


def bind_device_input(ort: Any, binding: Any, name: str, tensor: Tensor, stream: Stream) -> Any:
    """Bind ``tensor`` as input ``name``; returns what must stay alive until the run ends."""
    value = device_ortvalue(ort, name, tensor, stream)
    if isinstance(value, _RawDevice):
        binding.bind_input(
            name, "cuda", stream.device.index, value.dtype, list(value.shape), value.ptr
        )
    else:
        binding.bind_ortvalue_input(name, value)
    return value


def _check_device(name: str, tensor: Tensor, stream: Stream) -> None:
    if tensor.device_index is not None and tensor.device_index != stream.device.index:
        raise InvalidInputError(
            f"input {name!r} is on cuda:{tensor.device_index}, but the session runs on "
            f"{stream.device}; move it there first"
        )


class CudaGraphRunner:
    """ONNX Runtime's CUDA-graph mode behind static device buffers.

    Inputs are copied into buffers allocated once (host arrays by a copy to the device,
    device tensors by a device-to-device copy on the session's stream); the first run
    lets ORT capture its graph, and every later run replays it. Output buffers are
    static too: device outputs returned by :meth:`run` are overwritten by the next run.
    """

    def __init__(
        self,
        ort: Any,
        session: Any,
        shapes: dict[str, tuple[int, ...]],
        dtypes: dict[str, np.dtype],
        stream: Stream,
    ) -> None:
        self._ort, self._session, self._stream = ort, session, stream
        index = stream.device.index
        self._shapes = shapes
        self._inputs = {
            name: ort.OrtValue.ortvalue_from_shape_and_type(
                list(shape), dtypes[name], "cuda", index
            )
            for name, shape in shapes.items()
        }
        self._binding = session.io_binding()
        for name, value in self._inputs.items():
            self._binding.bind_ortvalue_input(name, value)
        self._input_ptrs = {name: value.data_ptr() for name, value in self._inputs.items()}
        self._output_names = [o.name for o in session.get_outputs()]
        for name in self._output_names:
            self._binding.bind_output(name, "cuda", index)
        self._outputs: list[Any] | None = None
        self._busy = threading.Lock()

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def warm_up(self, feeds: dict[str, np.ndarray]) -> None:
        """Run until ORT has captured its graph, so that later runs only replay."""
        self.run(feeds, self._output_names, "cuda")
        self.run(feeds, self._output_names, "cuda")

    def run(self, feeds: dict[str, Any], names: list[str], output_device: str | None) -> list[Any]:
        if not self._busy.acquire(blocking=False):
            raise UnsupportedOperationError(
                "run: another thread is running this CUDA-graph session; a captured graph "
                "has one set of buffers, so calls must not overlap (use one session per "
                "thread, or cuda_graph=False)"
            )
        try:
            for name, value in feeds.items():
                self._copy_in(name, value)
            self._session.run_with_iobinding(self._binding)
            if self._outputs is None:  # ORT allocated them on the first run: keep them
                self._outputs = self._binding.get_outputs()
                for name, value in zip(self._output_names, self._outputs):
                    self._binding.bind_ortvalue_output(name, value)
            chosen = [self._outputs[self._output_names.index(n)] for n in names]
            return chosen if output_device == "cuda" else [v.numpy() for v in chosen]
        finally:
            self._busy.release()

    def _copy_in(self, name: str, value: Any) -> None:
        shape = tuple(value.shape)
        if shape != self._shapes[name]:
            raise InvalidInputError(
                f"input {name!r}: shape {shape} differs from the captured {self._shapes[name]}; "
                "a CUDA-graph session replays fixed shapes (make another session for this one)"
            )
        if isinstance(value, Tensor):
            source = device_ortvalue(self._ort, name, value, self._stream)
            ptr = source.ptr if isinstance(source, _RawDevice) else source.data_ptr()
            nbytes = math.prod(shape) * value.dtype.itemsize
            self._stream.copy(self._input_ptrs[name], ptr, nbytes)
        else:
            self._inputs[name].update_inplace(value)

"""Loading and checking an ONNX model once, for every engine to use."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import ModelLoadError
from ._files import read_regular_file

__all__ = ["Model", "TensorSpec"]

MODEL_FILE_LIMIT = 2**31 - 1
"""Bytes an ONNX file may have: protobuf's own limit (larger models keep their weights
as external data)."""


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: its name, shape and element type.

    ``shape`` holds an int for a fixed dimension, a str for a named symbolic dimension
    (``"batch"``), and None for an unnamed dynamic one; ``shape`` itself is None when the
    model does not declare a rank. ``dtype`` is a numpy dtype.
    """

    name: str
    shape: tuple[int | str | None, ...] | None
    dtype: Any

    @property
    def is_dynamic(self) -> bool:
        return self.shape is None or any(not isinstance(d, int) for d in self.shape)

    def __str__(self) -> str:
        dims = (
            "?"
            if self.shape is None
            else ", ".join("?" if d is None else str(d) for d in self.shape)
        )
        return f"{self.name}: {self.dtype}[{dims}]"


class Model:
    """A checked ONNX model: where it came from, its digest and its I/O signature.

    Use :meth:`load`. Engines read ``path`` when the model came from a file (so that
    external data next to it is found) and ``data`` otherwise.
    """

    def __init__(self, path: Path | None, data: bytes, proto: Any) -> None:
        self._path = path
        self._data = data
        self._inputs = _specs(proto.graph.input, skip={i.name for i in proto.graph.initializer})
        self._outputs = _specs(proto.graph.output)
        self._opsets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
        self._name = proto.graph.name or (path.stem if path else "model")
        self._digest, external = _digest(data, proto, path)
        self._nbytes = len(data) + external

    @classmethod
    def load(cls, source: str | os.PathLike[str] | bytes | Any) -> Model:
        """Load and check a model from a path, serialized bytes or an ``onnx.ModelProto``.

        Raises
        ------
        ModelLoadError
            The file is missing or unreadable, the bytes are not an ONNX model
            (truncated, corrupted), or the ONNX checker rejects the graph.
        """
        if isinstance(source, Model):
            return source
        import onnx
        from google.protobuf.message import DecodeError

        path = None
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            try:
                data = read_regular_file(path, MODEL_FILE_LIMIT, "model file")
            except FileNotFoundError:
                raise ModelLoadError(f"model file not found: {path}") from None
            except ValueError as e:  # a FIFO, a device, a directory, over the limit
                raise ModelLoadError(str(e)) from None
            except OSError as e:
                raise ModelLoadError(f"cannot read model file {path}: {e}") from e
        elif isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, onnx.ModelProto):
            data = source.SerializeToString()
        else:
            raise ModelLoadError(
                f"model: expected a path, bytes or an onnx.ModelProto, got {type(source).__name__}"
            )
        where = str(path) if path else f"model bytes ({len(data)} B)"
        if not data:
            raise ModelLoadError(f"{where}: empty; expected a serialized ONNX model")
        try:
            proto = onnx.load_model_from_string(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            raise ModelLoadError(
                f"{where}: not a valid ONNX protobuf (truncated or corrupted?): {e}"
            ) from e
        try:
            if path is not None and _has_external_data(proto):
                onnx.checker.check_model(str(path))
            else:
                onnx.checker.check_model(proto)
        except (onnx.checker.ValidationError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{where}: the ONNX checker rejects this model: {e}") from e
        for value in list(proto.graph.input) + list(proto.graph.output):
            if not value.type.HasField("tensor_type"):
                raise ModelLoadError(
                    f"{where}: {value.name!r} is not a tensor; sessions take tensor I/O only"
                )
        return cls(path, data, proto)

    @property
    def path(self) -> Path | None:
        """The file the model came from, or None if it came from bytes."""
        return self._path

    @property
    def data(self) -> bytes:
        """The serialized model."""
        return self._data

    @property
    def name(self) -> str:
        return self._name

    @property
    def nbytes(self) -> int:
        """Bytes of the model with its external data files."""
        return self._nbytes

    @property
    def digest(self) -> str:
        """SHA-256 of the model bytes and any external data files (hex)."""
        return self._digest

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """Inputs a caller must feed (initializer-backed inputs excluded)."""
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def opsets(self) -> dict[str, int]:
        """Opset version per domain (``ai.onnx`` for the default domain)."""
        return dict(self._opsets)


def _specs(values: Any, skip: set[str] = frozenset()) -> tuple[TensorSpec, ...]:
    from onnx.helper import tensor_dtype_to_np_dtype

    specs = []
    for value in values:
        if value.name in skip:
            continue
        tensor = value.type.tensor_type
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else _symbol(d.dim_param)
                for d in tensor.shape.dim
            )
        try:
            dtype = tensor_dtype_to_np_dtype(tensor.elem_type)
        except (KeyError, ValueError):
            dtype = None
        specs.append(TensorSpec(value.name, shape, dtype))
    return tuple(specs)


def _symbol(name: str) -> str | None:
    # Exporters spell "unknown" as "?", "-1" or "None": anonymous, not one shared symbol.
    return None if name in ("", "?", "-1", "None") else name


def _has_external_data(proto: Any) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in proto.graph.initializer)


def _digest(data: bytes, proto: Any, path: Path | None) -> tuple[str, int]:
    """SHA-256 of the model and its external data (hex), and the external data's bytes."""
    h = hashlib.sha256(data)
    external = 0
    if path is not None and _has_external_data(proto):
        from onnx.external_data_helper import ExternalDataInfo, uses_external_data

        for location in sorted(
            {ExternalDataInfo(t).location for t in proto.graph.initializer if uses_external_data(t)}
        ):
            h.update(location.encode())
            try:
                content = (path.parent / location).read_bytes()
            except OSError as e:
                raise ModelLoadError(f"{path}: external data {location!r} unreadable: {e}") from e
            h.update(content)
            external += len(content)
    return h.hexdigest(), external

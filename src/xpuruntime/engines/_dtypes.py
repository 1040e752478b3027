"""Element types numpy cannot carry natively: bfloat16, float8, int4/uint4, int2/uint2,
float4.

``ml_dtypes`` gives them numpy dtypes (one byte or two per element), and the onnx
package maps ONNX element types onto those dtypes. Neither backend's numpy path takes
them: ONNX Runtime refuses ``session.run`` with such arrays, OpenVINO's ``Tensor``
does not map them, and both hand outputs back mislabelled (bfloat16 as float16, float8
as uint8). So they cross as raw bytes into a tensor of the declared ONNX type, and come
back as raw bytes viewed as the declared dtype. The 4-bit types are packed two to a
byte and the 2-bit types four to a byte, first element in the lowest bits, as ONNX,
ONNX Runtime and OpenVINO all store them. A type the table lacks is one no backend here
runs (``tests/test_dtypes.py`` checks every ``TensorProto`` type against ONNX Runtime).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TYPES", "ExoticType", "exotic_io", "exotic_type", "from_raw", "to_raw"]


class ExoticType:
    """How one such dtype crosses to a backend: its ONNX type, OpenVINO type and bits."""

    __slots__ = ("bits", "dtype", "onnx_type", "openvino_type")

    def __init__(self, dtype: np.dtype, onnx_type: int, openvino_type: str, bits: int) -> None:
        self.dtype, self.onnx_type, self.openvino_type, self.bits = (
            dtype,
            onnx_type,
            openvino_type,
            bits,
        )

    def nbytes(self, shape: tuple[int, ...]) -> int:
        count = int(np.prod(shape, dtype=np.int64))
        return (count * self.bits + 7) // 8


# ml_dtypes name -> (ONNX TensorProto type, OpenVINO element type or None, bits)
TYPES = {
    "bfloat16": (16, "bf16", 16),
    "float8_e4m3fn": (17, "f8e4m3", 8),
    "float8_e4m3fnuz": (18, None, 8),
    "float8_e5m2": (19, "f8e5m2", 8),
    "float8_e5m2fnuz": (20, None, 8),
    "uint4": (21, "u4", 4),
    "int4": (22, "i4", 4),
    "float4_e2m1fn": (23, "f4e2m1", 4),
    "float8_e8m0fnu": (24, "f8e8m0", 8),
    "uint2": (25, "u2", 2),
    "int2": (26, None, 2),  # OpenVINO 2026.4 has no signed 2-bit type
}
_FOUND: dict[np.dtype, ExoticType | None] = {}


def exotic_type(dtype: Any) -> ExoticType | None:
    """The crossing rule for ``dtype``, or None for a dtype numpy backends take as is."""
    try:
        return _FOUND[dtype]
    except (KeyError, TypeError):
        pass
    dtype = np.dtype(dtype)
    entry = TYPES.get(dtype.name)  # ml_dtypes names; their kind is "V" or "f"
    found = None if entry is None else ExoticType(dtype, *entry)
    _FOUND[dtype] = found
    return found


def exotic_io(specs: Any) -> dict[str, ExoticType]:
    """Input/output name -> crossing rule, for the ``specs`` of such dtypes."""
    found = {}
    for spec in specs:
        kind = None if spec.dtype is None else exotic_type(spec.dtype)
        if kind is not None:
            found[spec.name] = kind
    return found


def to_raw(array: np.ndarray, kind: ExoticType) -> np.ndarray:
    """The bytes a backend tensor of ``kind`` holds for ``array`` (uint8, packed)."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if kind.bits >= 8:
        return raw
    per_byte = 8 // kind.bits
    # ml_dtypes keeps a sub-byte value in the low bits of its byte (int4 -1 is 0x0F)
    values = raw & ((1 << kind.bits) - 1)
    if values.size % per_byte:
        values = np.concatenate([values, np.zeros(per_byte - values.size % per_byte, np.uint8)])
    values = values.reshape(-1, per_byte)
    packed = np.zeros(values.shape[0], np.uint8)
    for slot in range(per_byte):
        packed |= values[:, slot] << (slot * kind.bits)
    return packed


def from_raw(raw: np.ndarray, shape: tuple[int, ...], kind: ExoticType) -> np.ndarray:
    """An array of ``kind.dtype`` and ``shape`` from a backend tensor's bytes."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if kind.bits < 8:
        per_byte = 8 // kind.bits
        count = int(np.prod(shape, dtype=np.int64))
        unpacked = np.empty((raw.size, per_byte), np.uint8)
        for slot in range(per_byte):
            unpacked[:, slot] = (raw >> (slot * kind.bits)) & ((1 << kind.bits) - 1)
        return unpacked.reshape(-1)[:count].view(kind.dtype).reshape(shape)
    return raw[: kind.nbytes(shape)].copy().view(kind.dtype).reshape(shape)

"""Validating what a caller feeds a session, and generating inputs from metadata.

Dtype rule: an input must have the model's element type, or one numpy casts to it
*safely* within the same family: a narrower float to a wider float (float16 -> float32),
a narrower int to a wider int (int32 -> int64), an unsigned int to a wider signed or
unsigned int (uint8 -> int32). Such values are converted; anything else (float64 ->
float32, int64 -> float32, float -> int, bool -> number) is an error, because it would
lose information or change meaning silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import InvalidInputError
from ._model import TensorSpec
from .runtime._tensor import Tensor, describe_device_tensor, host_array

__all__ = ["InputValidator", "generate_inputs", "validate_inputs"]


class InputValidator:
    """``validate_inputs`` for one model, with a fast path for feeds that already conform.

    A session validates on every ``run``; most calls pass a dict or list of C-contiguous
    numpy arrays (or, on a GPU session, CUDA tensors) of the exact dtypes and shapes.
    Those are checked against rules compiled once here (about 1 µs per input) and passed
    through untouched; anything else goes through :func:`validate_inputs`, which
    converts what the dtype rule allows and names what is wrong.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, allow_device: bool = False) -> None:
        self._specs = tuple(specs)
        self._allow_device = allow_device
        self._rules = []
        for spec in self._specs:
            if spec.shape is None or spec.dtype is None:
                self._rules = None  # no fast path for undeclared ranks or types
                break
            fixed = tuple((a, d) for a, d in enumerate(spec.shape) if isinstance(d, int) and d > 0)
            symbolic = tuple((a, d) for a, d in enumerate(spec.shape) if isinstance(d, str))
            exact = tuple(spec.shape) if len(fixed) == len(spec.shape) else None
            self._rules.append((spec.name, spec.dtype, len(spec.shape), fixed, symbolic, exact))
        # Only a symbol that names more than one dimension can disagree with itself.
        seen: list[str] = [d for s in self._specs if s.shape for d in s.shape if isinstance(d, str)]
        self._shared_symbols = len(seen) != len(set(seen))

    def __call__(self, inputs: Any) -> dict[str, Any]:
        """The feeds for ``inputs``: passed through if they conform (a dict as it is,
        since engines only read it), else checked and converted in full."""
        rules, kind = self._rules, type(inputs)
        if rules is not None:
            if kind is dict and len(inputs) == len(rules):
                values = [inputs.get(rule[0]) for rule in rules]
            elif (kind is list or kind is tuple) and len(inputs) == len(rules):
                values = inputs
            else:
                values = None
            if values is not None:
                feeds = self._conforming(inputs, kind, values)
                if feeds is not None:
                    return feeds
        return validate_inputs(self._specs, inputs, allow_device=self._allow_device)

    def _conforming(self, inputs: Any, kind: type, values: Any) -> dict[str, Any] | None:
        """The feeds, if every value is already as the model declares it; else None."""
        rules = self._rules
        bound: dict[str, int] | None = {} if self._shared_symbols else None
        converted = False
        described = []
        for (name, dtype, ndim, fixed, symbolic, exact), value in zip(rules, values):
            if type(value) is np.ndarray:
                if (
                    value.dtype is not dtype and value.dtype != dtype
                ) or not value.flags.c_contiguous:
                    return None
                shape = value.shape
            elif self._allow_device and value is not None:
                device = describe_device_tensor(name, value)  # raises what the full path would
                if device is None or device.dtype != dtype:
                    return None
                shape, value, converted = device.shape, device, True
            else:
                return None
            if exact is not None:  # every dimension fixed: one comparison
                if shape != exact:
                    return None
                described.append(value)
                continue
            if len(shape) != ndim:
                return None
            for axis, size in fixed:
                if shape[axis] != size:
                    return None
            if bound is not None:
                for axis, sym in symbolic:
                    if bound.setdefault(sym, shape[axis]) != shape[axis]:
                        return None
            described.append(value)
        if kind is dict and not converted:
            return inputs
        return {rule[0]: value for rule, value in zip(rules, described)}


def validate_inputs(
    specs: Sequence[TensorSpec], inputs: Any, *, allow_device: bool = False
) -> dict[str, Any]:
    """Check ``inputs`` against ``specs``; return a name -> C-contiguous array dict.

    ``inputs`` is a mapping of name to array, or a list/tuple of arrays in the order of
    ``specs``. Arrays are numpy arrays or objects with ``__dlpack__`` on the host; with
    ``allow_device``, CUDA tensors too, which come back as :class:`Tensor`
    (never copied, so their dtype must be the model's exactly).

    Raises
    ------
    InvalidInputError
        Naming the input and what was expected vs. given.
    """
    expected = [s.name for s in specs]
    if isinstance(inputs, Mapping):
        unknown = [k for k in inputs if k not in expected]
        if unknown:
            raise InvalidInputError(
                f"unknown input name(s) {unknown!r}; the model's inputs are {expected}"
            )
        missing = [n for n in expected if n not in inputs]
        if missing:
            raise InvalidInputError(
                f"missing input(s) {missing}; the model's inputs are {expected}"
            )
        pairs = [(spec, inputs[spec.name]) for spec in specs]
    elif isinstance(inputs, (list, tuple)):
        if len(inputs) != len(specs):
            raise InvalidInputError(
                f"expected {len(specs)} input(s) {expected} in that order, got {len(inputs)}"
            )
        pairs = list(zip(specs, inputs))
    else:
        raise InvalidInputError(
            f"inputs: expected a dict of name -> array or a list of arrays for {expected}, "
            f"got {type(inputs).__name__}"
        )
    feeds: dict[str, Any] = {}
    bound: dict[str, tuple[int, str]] = {}  # symbolic dim -> (value, input that fixed it)
    for spec, value in pairs:
        on_device = describe_device_tensor(spec.name, value) if allow_device else None
        if on_device is not None:
            if spec.dtype is not None and on_device.dtype != spec.dtype:
                raise InvalidInputError(
                    f"input {spec.name!r}: expected dtype {spec.dtype}, got {on_device.dtype} "
                    "on the GPU (device tensors are bound without copying, so they are not "
                    "converted)"
                )
            _check_shape(spec, on_device, bound)
            feeds[spec.name] = on_device
            continue
        array = _as_array(spec.name, value)
        array = _check_dtype(spec, array)
        _check_shape(spec, array, bound)
        # Not np.ascontiguousarray: it turns a rank-0 array into shape (1,).
        feeds[spec.name] = array if array.flags.c_contiguous else array.copy(order="C")
    return feeds


def _as_array(name: str, value: Any) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ma.MaskedArray):
        raise InvalidInputError(
            f"input {name!r}: a masked array; engines would ignore its mask. Pass "
            "value.filled(fill_value) or value.data explicitly"
        )
    if isinstance(value, (np.ndarray, np.generic)):  # a numpy scalar is a rank-0 array
        return np.asarray(value)
    if hasattr(value, "__dlpack__") and not isinstance(value, (str, bytes)):
        return host_array(name, value)
    raise InvalidInputError(
        f"input {name!r}: expected a numpy array or a DLPack tensor, got {type(value).__name__}"
    )


def _check_dtype(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    want = spec.dtype
    if want is None or array.dtype == want:
        return array
    got = array.dtype
    same_family = got.kind == want.kind or (got.kind == "u" and want.kind == "i")
    if same_family and got.kind in "uif" and np.can_cast(got, want, casting="safe"):
        return array.astype(want)
    raise InvalidInputError(
        f"input {spec.name!r}: expected dtype {want}, got {got} "
        f"(only lossless widening within a family is converted; use .astype(np.{want}))"
    )


def _check_shape(
    spec: TensorSpec, array: np.ndarray | Tensor, bound: dict[str, tuple[int, str]]
) -> None:
    if spec.shape is None:
        return
    if array.ndim != len(spec.shape):
        raise InvalidInputError(
            f"input {spec.name!r}: expected rank {len(spec.shape)} {_fmt(spec.shape)}, "
            f"got rank {array.ndim} {tuple(array.shape)}"
        )
    for axis, (want, got) in enumerate(zip(spec.shape, array.shape)):
        if isinstance(want, int) and want > 0 and want != got:
            raise InvalidInputError(
                f"input {spec.name!r}: dimension {axis} must be {want} "
                f"(shape {_fmt(spec.shape)}), got {got} (shape {tuple(array.shape)})"
            )
        if isinstance(want, str):
            if want in bound and bound[want][0] != got:
                value, other = bound[want]
                raise InvalidInputError(
                    f"input {spec.name!r}: dimension {axis} ({want!r}) is {got}, but input "
                    f"{other!r} set {want!r} = {value}"
                )
            bound.setdefault(want, (got, spec.name))


def _fmt(shape: tuple) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def generate_inputs(
    specs: Sequence[TensorSpec],
    *,
    seed: int = 0,
    shapes: Mapping[str, Sequence[int]] | None = None,
    dynamic_dim: int = 1,
) -> dict[str, np.ndarray]:
    """Random inputs matching ``specs``, reproducible for a given ``seed``.

    Floats are standard normal, ints uniform in [0, 10), bools uniform. Dynamic dims are
    ``dynamic_dim`` unless ``shapes`` gives an input's whole shape.

    Raises
    ------
    InvalidInputError
        If ``shapes`` names an unknown input, or an input's type cannot be generated.
    """
    shapes = dict(shapes or {})
    unknown = set(shapes) - {s.name for s in specs}
    if unknown:
        raise InvalidInputError(
            f"shapes: unknown input(s) {sorted(unknown)}; inputs are {[s.name for s in specs]}"
        )
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        if spec.name in shapes:
            shape = tuple(int(d) for d in shapes[spec.name])
        elif spec.shape is None:
            raise InvalidInputError(
                f"input {spec.name!r} has no declared rank; give its shape explicitly"
            )
        else:
            shape = tuple(d if isinstance(d, int) and d > 0 else dynamic_dim for d in spec.shape)
        dtype = spec.dtype
        if dtype is None:
            raise InvalidInputError(f"input {spec.name!r}: cannot generate this element type")
        if dtype.kind == "f" or dtype.name == "bfloat16":
            out[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            out[spec.name] = rng.integers(0, 10, size=shape).astype(dtype)
        elif dtype.kind == "b":
            out[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise InvalidInputError(f"input {spec.name!r}: cannot generate dtype {dtype}")
        _check_shape(spec, out[spec.name], {})
    return out

"""The one exception hierarchy of xpuruntime.

Every error a user can see derives from :class:`XpuRuntimeError`. Backend exceptions
(ONNX Runtime, OpenVINO, the CUDA driver) are translated in one place per backend and
chained with ``raise ... from original`` so that the native message is never lost.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "XpuRuntimeError",
    "CudaError",
    "OutOfMemoryError",
    "UnsupportedOperationError",
    "BackendUnavailableError",
    "InvalidInputError",
    "PolicyError",
    "ModelLoadError",
    "ExecutionError",
    "shown",
]

_MESSAGE_LIMIT = 4000
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlevel = 4


def shown(value: object) -> str:
    """A bounded ``repr`` of a user's value for an error message.

    Bounded in size and in time: a 50 MB string or a YAML alias bomb (a few hundred
    bytes that expand to gigabytes when printed in full) shows as a short prefix.
    """
    return _REPR.repr(value)


class XpuRuntimeError(RuntimeError):
    """Base class of every error raised by xpuruntime."""


class CudaError(XpuRuntimeError):
    """A CUDA driver or runtime call failed, or a CUDA device does not exist.

    Parameters
    ----------
    message : str
        What was being done and what went wrong.
    code : str, optional
        The driver's error name (for example ``"CUDA_ERROR_INVALID_DEVICE"``).
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message if code is None else f"{message} [{code}]")
        self.code = code


class OutOfMemoryError(XpuRuntimeError, MemoryError):
    """An allocation failed; the message says what was asked for and what was free."""


class UnsupportedOperationError(XpuRuntimeError):
    """No candidate (engine or kernel) can do what was asked; the message lists why.

    Attributes
    ----------
    rejected : tuple of (str, str)
        Each rejected candidate's name with the reason it was rejected.
    """

    def __init__(self, message: str, rejected: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.rejected = tuple(rejected)


class BackendUnavailableError(XpuRuntimeError):
    """A backend library is not installed or cannot run here; says what to install."""


class InvalidInputError(XpuRuntimeError, ValueError):
    """An input value is wrong: names the input, what was expected and what was given."""


class PolicyError(XpuRuntimeError, ValueError):
    """A policy value or file is invalid: names the field or file and the valid choices."""

    def __init__(self, message: str) -> None:
        if len(message) > _MESSAGE_LIMIT:
            message = (
                f"{message[:_MESSAGE_LIMIT]}... ({len(message) - _MESSAGE_LIMIT} more characters)"
            )
        super().__init__(message)


class ModelLoadError(XpuRuntimeError):
    """A model is missing, truncated, invalid, or an engine could not compile it."""


class ExecutionError(XpuRuntimeError):
    """An engine failed while running a model on inputs that passed validation.

    The message names the engine and, where the backend says, the node or op that
    failed; the backend's exception is chained. Failures the inputs caused (a shape the
    model cannot take) are :class:`InvalidInputError` instead.
    """

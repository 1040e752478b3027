"""Mixed precision on the right device type, recorded in the dispatch log."""

from __future__ import annotations

import threading

import torch

from ..._errors import PolicyError, UnsupportedOperationError
from ._ranges import annotate

__all__ = ["autocast", "autocast_region"]

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_regions = threading.local()  # device type -> stack of precisions, per thread


def autocast_region(device_type: str) -> str | None:
    """The precision of the innermost enabled :class:`autocast` block on this thread."""
    stack = getattr(_regions, device_type, None)
    return stack[-1] if stack else None


class autocast:
    """``torch.autocast`` on this machine's accelerator (the CPU when there is none).

    Ops in the block run in ``dtype`` where PyTorch's autocast lists allow it; the
    dispatch log records ``precision="autocast bf16"`` (or fp16) for each op it sees.

    Parameters
    ----------
    dtype : torch.float16 or torch.bfloat16
        float16 by default, as the seed documents (05 §4.2) and ``torch.autocast`` on
        CUDA have it; bfloat16 needs no loss scaling and is the better choice on GPUs
        that have it (Ampere and later).
    enabled : bool
    cache_enabled : bool
        Keep the low-precision copies of weights for the block (PyTorch's cache).
    device_type : {'cuda', 'cpu'}, optional
        Default: ``'cuda'`` when CUDA is available, else ``'cpu'``.

    Raises
    ------
    PolicyError
        ``dtype`` is not float16/bfloat16, or ``device_type`` is not cuda/cpu.
    UnsupportedOperationError
        bf16 on a CUDA device without bf16 support.

    Examples
    --------
    >>> with xpt.autocast(dtype=torch.bfloat16):            # doctest: +SKIP
    ...     loss = model(batch).float().mean()
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        enabled: bool = True,
        cache_enabled: bool = True,
        device_type: str | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise PolicyError(
                f"autocast dtype: expected torch.float16 or torch.bfloat16, got {dtype!r}"
            )
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type not in ("cuda", "cpu"):
            raise PolicyError(
                f"autocast device_type: expected 'cuda' or 'cpu', got {device_type!r}"
            )
        if enabled and device_type == "cuda" and dtype == torch.bfloat16:
            if not torch.cuda.is_bf16_supported():
                raise UnsupportedOperationError(
                    f"autocast: {torch.cuda.get_device_name()} has no bf16 support; "
                    "use dtype=torch.float16"
                )
        self.dtype = dtype
        self.device_type = device_type
        self.enabled = enabled
        self._inner = torch.autocast(
            device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
        )
        self._range = None

    @property
    def precision(self) -> str:
        """``'fp16'`` or ``'bf16'``."""
        return _DTYPES[self.dtype]

    def __enter__(self) -> autocast:
        self._range = annotate(f"autocast {self.precision} on {self.device_type}")
        self._range.__enter__()
        self._inner.__enter__()
        if self.enabled:
            stack = getattr(_regions, self.device_type, None)
            if stack is None:
                stack = []
                setattr(_regions, self.device_type, stack)
            stack.append(self.precision)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._inner.__exit__(*exc)
        finally:
            if self.enabled:
                getattr(_regions, self.device_type).pop()
            self._range.__exit__(*exc)
            self._range = None

    def __repr__(self) -> str:
        return (
            f"autocast(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"enabled={self.enabled})"
        )

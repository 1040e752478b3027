"""Build the native launcher ahead of time: ``python -m xpuruntime.pytorch.build``.

The C++ side that replays our Triton launches (:mod:`._ops._infra._native`) is otherwise built
by the first call that needs it (about 30-60 s). Run this once in a container image or
before a read-only deployment, with the same ``TORCH_EXTENSIONS_DIR`` (if any) as the
jobs that will load it; they then load the built library without writing anything.
Exits 0 when the launcher is ready, 1 with the reason when it cannot be (the switch
``XPURUNTIME_NATIVE_LAUNCH=0``, no CUDA headers or compiler, another process's build
that does not finish).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    """Build (or find) the native launcher; 0 when ready, 1 with the reason on stderr."""
    from ._ops._infra import _native

    try:
        module = _native.build()
    except Exception as e:
        sys.stderr.write(f"not built: {type(e).__name__}: {e}\n")
        return 1
    sys.stdout.write(f"native launcher ready: {module.__file__}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

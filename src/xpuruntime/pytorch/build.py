"""Build the native launcher and the LoRA op's C++ node ahead of time:
``python -m xpuruntime.pytorch.build``.

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
    """Build (or find) the native launcher and the LoRA node; 0 when both are ready, 1
    with the reason on stderr."""
    from ._ops._infra import _native

    try:
        module = _native.build()
    except Exception as e:
        sys.stderr.write(f"not built: {type(e).__name__}: {e}\n")
        return 1
    sys.stdout.write(f"native launcher ready: {module.__file__}\n")
    node = _native.lora_node()
    if node is None:
        sys.stderr.write(f"LoRA node not built: {_native.lora_node_unavailable()}\n")
        return 1
    sys.stdout.write(f"LoRA node ready: {node.__file__}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

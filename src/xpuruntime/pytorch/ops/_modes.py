"""What the layers above this floor tell its kernels: set there, read here per call.

``recording``: the dispatch log records (``xpuruntime.pytorch.enable_dispatch_logging``),
so calls go through our registered torch ops, which it sees. ``strict``: the kernel
policy in force is strict, so a direct op call that cannot run our kernel raises rather
than falling back to PyTorch's op.
"""

recording = False
strict = False

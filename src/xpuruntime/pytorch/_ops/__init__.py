"""Our kernels as PyTorch ops, one op per module (Triton kernels, their launchers,
autograd and fake implementations), with what they share (``_launch``,
``_cached_launch``, ``_native``, ...): the floor of ``xpuruntime.pytorch``, importing
nothing from the package above it. The public ones are :mod:`xpuruntime.pytorch.ops`'s.
"""

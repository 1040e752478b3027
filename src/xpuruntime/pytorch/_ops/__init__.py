"""Our kernels as PyTorch ops, one op per module (Triton kernels, their launchers,
autograd and fake implementations), what they share in ``_infra/``: the floor of
``xpuruntime.pytorch``, importing nothing from the package above it. The public ones are
:mod:`xpuruntime.pytorch.ops`'s.

One naming scheme in every op module: ``<op>`` (the op as users call it, its inputs
checked), ``check_<op>`` (that check alone), ``run_<op>`` (the kernels, for callers that
checked), ``replay_<op>`` (a launch plan's replay), ``torch_<op>`` (PyTorch's expression
of the same, the reference and the fallback) and ``unsupported(...)`` (why the kernels
cannot take a call, None where they can).
"""

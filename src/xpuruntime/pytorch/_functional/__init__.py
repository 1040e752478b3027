"""The routed ops' Python faces: what a model, our modules (:mod:`..nn`) and the
forwards :func:`~xpuruntime.pytorch.optimize` binds call: the norms, linear layers and
their GELU, the residual add and norm, rotary embedding, SwiGLU/GeGLU, joined
projections, attention and the fused LM head. Each declares its ``RoutedOp`` (signature,
context, timing sample); the policy machinery (``_selection/``) below it chooses and runs
the kernel. ``_modules`` holds the drop-in modules that :mod:`..nn` makes public."""

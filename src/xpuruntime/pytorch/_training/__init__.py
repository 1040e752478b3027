"""Whole training steps: ``make_train_step`` and its graphed form (``_train_step``),
CUDA graph capture (``_graphs``) and the caching allocator's settings (``_allocator``)."""

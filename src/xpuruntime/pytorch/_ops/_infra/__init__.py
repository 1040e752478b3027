"""What the ops share: where a kernel may run and its launch (``_launch``,
``_cached_launch``, the C++ launch plans of ``_native``), op registration (``_op``), the
norms' rows and partial sums, and the helpers one or two ops share (kept casts of frozen
weights, gradient targets, LoRA dropout, recomputed activations, attention inputs,
cuBLASLt epilogues)."""

"""The policy machinery of the PyTorch wing: the kernel policy in force and its
process-wide switches (``_policy``, ``_resolution``), the routed op that resolves and runs
each call's kernel (``_routed``), the timing that ``best_performance`` measures with
(``_timing``), the dispatch log's PyTorch side (``_logging``), ranges and profiles
(``_ranges``, ``_profile``) and autocast (``_autocast``). Above ``ops/`` and ``_kernels/``,
below the routed ops' faces (``_functional/``)."""

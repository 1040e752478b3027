"""``optimize(model)``: what a model's modules compute, recognised on probe inputs
(``_probes``), rewritten per instance by statements (``_statements``, over the function
surgery of ``_functions``) with their fused forwards (``_apply``), or by
``torch.fx`` (``_rewrite``), with the report and its undo. Above the routed ops' faces
(``_functional/``) and :mod:`..nn`."""

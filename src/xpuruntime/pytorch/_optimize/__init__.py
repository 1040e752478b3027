"""``optimize(model)``: what a model's modules compute, recognised on probe inputs
(``_recognise``), rewritten per instance with their fused forwards (``_apply``) or by
``torch.fx`` (``_rewrite``), with the report and its undo. Above the routed ops' faces
(``_functional/``) and :mod:`..nn`."""

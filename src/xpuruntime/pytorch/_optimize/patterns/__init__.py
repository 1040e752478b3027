"""The patterns :func:`~xpuruntime.pytorch.optimize` applies, one file each, in one
table whose order is the order they run in (pinned by a test).

Per module, in :data:`MODULE_PATTERNS` order (a pattern that settles a module ends its
turn): a gated MLP's activation (:mod:`.gated_mlp`), then the module's own forward
rewritten by statements (:mod:`.forward`: the :data:`STATEMENTS` kinds, residual add and
norm before linear and GELU, then joined projections, then per-head q/k norms with the
rotary embedding (:mod:`.head_norms`), and by name the rotary embedding
and the causal mask under ``torch.compile`` (:mod:`.causal_mask`)), then a LoRA layer's
adapter with its base (:mod:`.lora`), then the LM head (:mod:`.head`), then the norm and
linear swaps (:mod:`.swaps`).
Then, over the whole model, the :data:`MODEL_PATTERNS`: the ``torch.fx`` rewrite
(:mod:`.fx`), for the ops a policy names there, the activation offload of checkpointed
layers (:mod:`.offload`), the fused LoRA layers' frozen bases stored in FP8
(:mod:`.fp8_base`), no KV cache in training forwards (:mod:`.training_cache`), and
last, decoder layers replaying CUDA graphs in training, or watched for a loop waiting on
its host (:mod:`.layer_graphs`).

Which engine fuses what is explicit here: the statement engine (:mod:`.._statements`)
binds the residual add and norm of decoder layers, linear and GELU under ``auto``, the
joined projections and the rotary embedding; the fx engine (:mod:`.._rewrite`) only
what a policy names as ``residual_layernorm``, ``linear_gelu`` or ``mlp`` (the linear
and GELU statement pattern leaves a module the fx engine will trace).

A pattern has ``findings`` (what the report lists, :class:`.._report.Finding`),
``enabled(run)`` and ``apply(run, path, parent, name, module) -> bool`` (True: the
module is settled), or for a model pattern ``apply_model(run)``; it acts through the
:class:`.._run.Run`, which logs every undo.
"""

from . import (
    causal_mask,
    forward,
    fp8_activations,
    fp8_base,
    fx,
    gated_mlp,
    head,
    head_norms,
    layer_graphs,
    linear_act,
    lora,
    offload,
    projections,
    residual,
    rope,
    swaps,
    training_cache,
)

STATEMENTS = (residual.PATTERN, linear_act.PATTERN, projections.PATTERN, head_norms.PATTERN)
"""The statement kinds a module's forward is rewritten by, in the order they match."""

MODULE_PATTERNS = (
    gated_mlp.PATTERN,
    forward.RewrittenForward(STATEMENTS, rope.PATTERN, causal_mask.PATTERN),
    lora.PATTERN,
    head.PATTERN,
    swaps.PATTERN,
)
MODEL_PATTERNS = (
    fx.PATTERN,
    offload.PATTERN,
    fp8_base.PATTERN,
    fp8_activations.PATTERN,
    training_cache.PATTERN,
    layer_graphs.PATTERN,
)

FINDINGS = (
    residual.FUSED,
    linear_act.FUSED,
    fx.MLPS,
    gated_mlp.SWIGLUS,
    gated_mlp.GEGLUS,
    rope.FUSED,
    head_norms.FUSED,
    projections.JOINED,
    projections.STORED,
    lora.FUSED,
    lora.BARE,
    causal_mask.LEFT,
    causal_mask.DOCUMENTS,
    causal_mask.TRUSTED,
    causal_mask.SYNCS,
    head.OUTSIDE,
    offload.OFFLOADED,
    fp8_base.STORED,
    fp8_activations.KEPT,
    training_cache.CACHES,
    layer_graphs.GRAPHED,
    layer_graphs.WATCHED,
)
"""What the report lists, in the order of its summary and lines."""

"""What :func:`~xpuruntime.pytorch.optimize` changed in a model, how to undo it (one
log, played back), and the findings its patterns report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...policies import KernelPolicy
from .._selection._policy import clear_kernel_policy, set_kernel_policy

__all__ = ["Finding", "OptimizationReport"]


@dataclass(frozen=True)
class Finding:
    """One kind of thing a pattern reports: the report's attribute that lists it, its
    count's label in the summary (after ``verb``), and the line each item gets."""

    field: str
    label: str
    line: str
    verb: str = "fused"
    listed_when_empty: bool = True  # in the summary even at 0 (the report's text of old)


class OptimizationReport:
    """What :func:`optimize` changed in a model, and how to undo it.

    Attributes
    ----------
    replaced : list of (str, str, str)
        (module path, original class, new class) for each module replaced.
    skipped : list of (str, str)
        (module path, reason) for each module considered and left alone.
    fused_residuals : list of str
        The norms whose input residual add now runs fused with them (the policy's
        ``residual_layernorm`` op, or ``residual_rmsnorm`` in decoder layers whose
        forward is bound on the instance), by path.
    fused_gelus : list of str
        The linear layers whose GELU now runs fused with them (the policy's
        ``linear_gelu`` op), by path.
    fused_mlps : list of str
        The first linear layers of the MLPs (linear, GELU, linear) that now run as one
        op (the policy's ``mlp`` op), by path.
    fused_swiglus : list of str
        The SwiGLU MLPs (``down(silu(gate(x)) * up(x))``, recognised by what they
        compute) whose activation now runs as the policy's ``swiglu`` op, by path; their
        forward is bound on the instance (the class and other models are untouched).
    fused_geglus : list of str
        Likewise the GeGLU MLPs (``down(gelu_tanh(gate(x)) * up(x))``, Gemma's), whose
        activation now runs as the policy's ``geglu`` op.
    fused_ropes : list of str
        The attention modules whose rotary embedding (their modeling file's
        ``apply_rotary_pos_emb``, recognised by what it computes) now runs as the
        policy's ``rope`` op, by path; their forward is bound on the instance.
    joined_projections : list of str
        Linear layers that take one input and now run as the policy's ``projections``
        op (one GEMM where it picks ``fused``), as ``"<module path>: q_proj, k_proj,
        v_proj"``; their module's forward is bound on the instance.
    causal_masks_left_to_sdpa : list of str
        The models whose full-attention mask, where it would be plain causal, is left
        to SDPA's ``is_causal`` under ``torch.compile`` as transformers leaves it in
        eager (``patterns/causal_mask.py``), by path; their forward is bound on the
        instance.
    packed_masks_as_documents : list of str
        The models whose packed batches' masks (positions restarting per document, no
        padding mask or cache) are kept as their documents, on which SDPA runs our Triton
        kernel within each document (``patterns/causal_mask.py``), by path.
    host_syncs_removed : list of str
        The models whose forward builds its masks without reading the positions it made
        itself and its KV cache's sliding windows on the device, where transformers
        waits for the GPU in every forward (``patterns/causal_mask.py``), by path.
    heads_outside_the_graph : list of str
        The models whose LM head and what follows it (the loss) run outside the graph
        under torch.compile with gradients on, the logits deferred and the loss fused as in eager
        (``patterns/head.py``), by path; their forward is bound on the instance.
    kv_caches_in_training : list of str
        ``["<model>"]`` where the model's config leaves ``use_cache`` on, so that
        transformers builds a KV cache in training forwards too (a finding: the model
        is left as it is).
    attention : str
        How the model's attention is routed under the policy.
    policy : KernelPolicy or None
        The policy set by :func:`optimize` (None when it was called without one).

    The finding lists (``fused_*``, ``joined_projections``) are the patterns' (see
    ``patterns/``): their order is the summary's.
    """

    def __init__(self, findings: tuple[Finding, ...]) -> None:
        self.replaced: list[tuple[str, str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.attention = ""
        self.policy: KernelPolicy | None = None
        self._findings = findings
        self._found: dict[str, list[str]] = {f.field: [] for f in findings}
        self._undo: list[Callable[[], None]] = []  # played back in reverse by revert()
        self._previous_policy: KernelPolicy | None = None
        self._reverted = False

    def __getattr__(self, name: str) -> Any:
        found = self.__dict__.get("_found")
        if found is not None and name in found:
            return found[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def add(self, finding: Finding, items: list[str]) -> None:
        """Report ``items`` under ``finding``."""
        self._found[finding.field] += items

    def on_revert(self, undo: Callable[[], None]) -> None:
        """Log ``undo`` for :meth:`revert` (which runs the log last first)."""
        self._undo.append(undo)

    def swapped(
        self, path: str, parent: nn.Module, name: str, old: nn.Module, was: str, now: str
    ) -> None:
        """``parent.<name>`` (at ``path``, once ``old``, described as ``was``) is now
        ``now``."""
        self.replaced.append((path, was, now))
        self.on_revert(lambda: setattr(parent, name, old))

    def revert(self) -> None:
        """Put every original module and forward back, and the kernel policy from before;
        drop the frozen weights' casts kept between steps."""
        if self._reverted:
            return
        for undo in reversed(self._undo):
            undo()
        from ..ops._frozen_casts import forget_frozen_casts

        forget_frozen_casts()
        if self.policy is not None:
            if self._previous_policy is None:
                clear_kernel_policy()
            else:
                set_kernel_policy(self._previous_policy)
        self._reverted = True

    def __str__(self) -> str:
        return "\n".join([self._summary(), *self._lines()])

    def _summary(self) -> str:
        parts = [f"replaced {len(self.replaced)} module(s)"]
        groups: list[tuple[str, list[str]]] = []
        for f in self._findings:  # consecutive findings of one verb share it
            if not (f.listed_when_empty or self._found[f.field]):
                continue
            text = f"{len(self._found[f.field])} {f.label}"
            if groups and groups[-1][0] == f.verb:
                groups[-1][1].append(text)
            else:
                groups.append((f.verb, [text]))
        for verb, texts in groups:
            listed = texts[0] if len(texts) == 1 else f"{', '.join(texts[:-1])} and {texts[-1]}"
            parts.append(f"{verb} {listed}")
        return ", ".join([*parts, f"skipped {len(self.skipped)}"])

    def _lines(self) -> list[str]:
        lines = [f"  {path}: {old} -> {new}" for path, old, new in self.replaced]
        for f in self._findings:
            lines += [f"  {f.line.format(item)}" for item in self._found[f.field]]
        lines += [f"  {path}: skipped, {why}" for path, why in self.skipped]
        return [*lines, f"attention: {self.attention}"]

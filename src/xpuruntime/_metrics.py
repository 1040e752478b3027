"""How far outputs are from a reference, by the accuracy gate's metrics: what sessions,
:func:`~xpuruntime.inference.compare` and the int8 gate of the engines judge with.
Nothing here runs a model, so engines may use it without a session."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .policies import AccuracyPolicy

__all__ = ["OutputComparison", "compare_batches", "compare_outputs"]


@dataclass(frozen=True)
class OutputComparison:
    """One engine's one output against the reference.

    ``max_rel`` divides by ``max(|ref|, atol)`` (``atol`` floored at float32's tiniest
    normal) so that elements near zero do not dominate it; ``rel_l2`` is
    ``||out - ref|| / ||ref||``; ``top1_agreement`` the share of rows over the last axis
    whose argmax equals the reference's (NaN without such an axis). ``passed``: by the
    gate's metric (:class:`~xpuruntime.AccuracyPolicy`), by default every element within
    ``atol + rtol * |ref|``. ``error`` is set (and the figures are NaN) when the engine
    could not run.
    """

    engine: str
    output: str
    max_abs: float
    max_rel: float
    rel_l2: float
    passed: bool
    error: str | None = None
    top1_agreement: float = np.nan

    def figure(self, metric: str) -> float:
        """The figure ``metric`` judges (``max_rel`` for ``'allclose'``)."""
        return getattr(self, "max_rel" if metric == "allclose" else metric)


def compare_outputs(
    engine: str,
    names: Sequence[str],
    outputs: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    rtol: float,
    atol: float,
    gate: AccuracyPolicy | None = None,
) -> list[OutputComparison]:
    """Compare each output with its reference by the rule of :class:`OutputComparison`;
    ``gate`` names the metric that decides ``passed`` (default: ``allclose`` with
    ``rtol`` and ``atol``)."""
    rows = []
    for name, out, ref in zip(names, outputs, reference):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            rows.append(
                OutputComparison(
                    engine,
                    name,
                    np.nan,
                    np.nan,
                    np.nan,
                    False,
                    f"shape {out.shape} != reference {ref.shape}",
                )
            )
            continue
        out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
        diff = np.abs(out64 - ref64)
        if not np.all(np.isfinite(out64) == np.isfinite(ref64)):
            rows.append(
                OutputComparison(
                    engine,
                    name,
                    np.inf,
                    np.inf,
                    np.inf,
                    False,
                    "non-finite values differ from the reference",
                )
            )
            continue
        diff = np.where(np.isfinite(ref64), diff, 0.0)
        floor = max(atol, float(np.finfo(np.float32).tiny))
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(ref64), floor)).max()) if diff.size else 0.0
        norm = float(np.linalg.norm(np.where(np.isfinite(ref64), ref64, 0.0)))
        rel_l2 = (
            float(np.linalg.norm(diff)) / norm if norm > 0 else (0.0 if max_abs == 0 else np.inf)
        )
        top1 = np.nan
        if out64.ndim and out64.shape[-1] > 1 and out64.size:
            top1 = float(np.mean(np.argmax(out64, axis=-1) == np.argmax(ref64, axis=-1)))
        if gate is None or gate.metric == "allclose":
            within = atol + rtol * np.abs(np.where(np.isfinite(ref64), ref64, 0))
            passed = bool(np.all(diff <= within))
        elif gate.metric == "top1_agreement":
            passed = bool(top1 >= gate.bound)  # NaN (no class axis) fails
        else:
            passed = bool({"rel_l2": rel_l2, "max_abs": max_abs}[gate.metric] <= gate.bound)
        rows.append(OutputComparison(engine, name, max_abs, max_rel, rel_l2, passed, None, top1))
    return rows


def compare_batches(
    engine: str,
    names: Sequence[str],
    outputs: Sequence[Sequence[np.ndarray]],
    reference: Sequence[Sequence[np.ndarray]],
    gate: AccuracyPolicy,
) -> list[OutputComparison]:
    """:func:`compare_outputs` over several batches at once: each output's batches are
    joined (rows over the last axis, where the batches share it), so that ``rel_l2`` is
    the whole set's and ``top1_agreement`` counts every row."""
    joined_out, joined_ref = [], []
    for index in range(len(names)):
        outs = [np.asarray(batch[index]) for batch in outputs]
        refs = [np.asarray(batch[index]) for batch in reference]
        if any(o.shape != r.shape for o, r in zip(outs, refs)):
            bad = next((o.shape, r.shape) for o, r in zip(outs, refs) if o.shape != r.shape)
            joined_out.append(np.zeros(bad[0]))
            joined_ref.append(np.zeros(bad[1]))
            continue
        lasts = {o.shape[-1] if o.ndim else 1 for o in outs}
        width = lasts.pop() if len(lasts) == 1 else 1
        joined_out.append(np.concatenate([o.reshape(-1, width) for o in outs]))
        joined_ref.append(np.concatenate([r.reshape(-1, width) for r in refs]))
    return compare_outputs(engine, names, joined_out, joined_ref, gate.rtol, gate.atol, gate)

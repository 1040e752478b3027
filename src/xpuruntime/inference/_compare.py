"""Cross-engine accuracy: the same inputs through several engines, against a reference."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import XpuRuntimeError
from .._model import Model
from ..policies import AccuracyPolicy, ExecutionPolicy
from ._inputs import generate_inputs, validate_inputs

__all__ = [
    "ComparisonReport",
    "OutputComparison",
    "compare",
    "compare_batches",
    "compare_outputs",
]

logger = logging.getLogger("xpuruntime.inference")

REFERENCE = ExecutionPolicy(engine="onnxrt", device="cpu", precision="fp32", strict=True)


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


@dataclass(frozen=True)
class ComparisonReport:
    """Per engine and output, how far from the reference; see :func:`compare`."""

    reference: str
    rtol: float
    atol: float
    rows: tuple[OutputComparison, ...]

    @property
    def passed(self) -> bool:
        """Whether every engine passed on every output."""
        return all(row.passed for row in self.rows)

    @property
    def failures(self) -> list[OutputComparison]:
        return [row for row in self.rows if not row.passed]

    def engine_passed(self, engine: str) -> bool:
        return all(row.passed for row in self.rows if row.engine == engine)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "rtol": self.rtol,
            "atol": self.atol,
            "rows": [row.__dict__ for row in self.rows],
        }

    def __str__(self) -> str:
        lines = [
            f"reference: {self.reference}; pass if |out-ref| <= {self.atol:g} + {self.rtol:g}*|ref|"
        ]
        for r in self.rows:
            verdict = "PASS" if r.passed else "FAIL"
            if r.error:
                lines.append(f"  {r.engine:10s} {r.output:20s} {verdict}: {r.error}")
            else:
                lines.append(
                    f"  {r.engine:10s} {r.output:20s} {verdict} max_abs={r.max_abs:.3g} "
                    f"max_rel={r.max_rel:.3g} rel_l2={r.rel_l2:.3g}"
                )
        return "\n".join(lines)


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


def reference_outputs(model: Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ONNX Runtime on the CPU in fp32, the reference every engine meets."""
    from ._session import InferenceSession

    with InferenceSession(model, policy=REFERENCE) as session:
        return session.run(dict(feeds))


def compare(
    model: Any,
    engines: Sequence[str] | None = None,
    inputs: Any = None,
    *,
    device: str = "cpu",
    precision: str = "fp32",
    rtol: float = 1e-3,
    atol: float = 1e-4,
    seed: int = 0,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> ComparisonReport:
    """Run the same inputs through each engine and compare with ONNX Runtime CPU fp32.

    Parameters
    ----------
    model : path, bytes or onnx.ModelProto
    engines : list of str, optional
        Engine names (default: every registered engine that runs on ``device``).
    inputs : dict or list of arrays, optional
        Fed to every engine; generated from the model's metadata with ``seed`` if None
        (dynamic dims 1, or ``shapes``).
    device, precision : str
        Where and in which precision the compared engines run (strictly: an engine that
        cannot honour them is reported as failed with the reason, not replaced).
    rtol, atol : float
        Pass if every element satisfies ``|out - ref| <= atol + rtol * |ref|``.

    Returns
    -------
    ComparisonReport

    Examples
    --------
    >>> report = compare("model.onnx", engines=["onnxrt", "openvino"])  # doctest: +SKIP
    >>> report.passed  # doctest: +SKIP
    True
    """
    from ..engines import engines as registry
    from ._session import InferenceSession

    loaded = Model.load(model)
    feeds = (
        generate_inputs(loaded.inputs, seed=seed, shapes=shapes)
        if inputs is None
        else validate_inputs(loaded.inputs, inputs)
    )
    reference = reference_outputs(loaded, feeds)
    names = [s.name for s in loaded.outputs]
    policy = ExecutionPolicy(device=device, precision=precision, strict=True)
    rows: list[OutputComparison] = []
    for engine in engines or registry.order(policy.device.split(":")[0]):
        try:
            with InferenceSession(loaded, policy=policy.replace(engine=engine)) as session:
                outputs = session.run(feeds)
        except XpuRuntimeError as e:
            logger.info("compare: %s could not run: %s", engine, e)
            rows.extend(
                OutputComparison(
                    engine, n, np.nan, np.nan, np.nan, False, f"{type(e).__name__}: {e}"
                )
                for n in names
            )
            continue
        rows.extend(compare_outputs(engine, names, outputs, reference, rtol, atol))
    return ComparisonReport("onnxrt cpu fp32", rtol, atol, tuple(rows))

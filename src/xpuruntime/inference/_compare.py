"""Cross-engine accuracy: the same inputs through several engines, against a reference."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import XpuRuntimeError
from .._inputs import generate_inputs, validate_inputs
from .._metrics import OutputComparison, compare_batches, compare_outputs
from .._model import Model
from ..policies import ExecutionPolicy

__all__ = [
    "ComparisonReport",
    "OutputComparison",
    "compare",
    "compare_batches",
    "compare_outputs",
]

logger = logging.getLogger("xpuruntime.inference")


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


def reference_outputs(model: Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ONNX Runtime on the CPU in fp32, the reference every engine meets."""
    from ._session import REFERENCE, InferenceSession

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

"""Offline batch inference with Ray Data: one session per actor, numpy batches in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Predictor", "SessionHolder"]


class SessionHolder:
    """One :class:`~xpuruntime.InferenceSession` per Ray worker (replica or actor),
    built where the worker runs, with its decision exposed."""

    def __init__(
        self,
        model: Any,
        policy: Any = None,
        device: str | None = None,
        engine: str | None = None,
        *,
        sample_inputs: Any = None,
    ) -> None:
        from ..inference import InferenceSession

        self.session = InferenceSession(
            model, device=device, engine=engine, policy=policy, sample_inputs=sample_inputs
        )

    @property
    def decision(self) -> dict[str, Any]:
        """This worker's engine decision (engine, source, reason, device, settings)."""
        decision = self.session.decision
        return {
            "engine": decision.chosen,
            "source": decision.source,
            "reason": decision.reason,
            "device": str(self.session.device),
            "settings": self.session.engine_settings,
        }


class Predictor(SessionHolder):
    """A Ray Data callable class that runs batches through one session per actor.

    Parameters
    ----------
    model : path or bytes
        The ONNX model (a path every worker can read, or its bytes).
    policy, device, engine, sample_inputs
        As :class:`~xpuruntime.InferenceSession`.
    columns : dict, optional
        Model input name -> dataset column (default: the same names).
    output_names : list of str, optional
        Which outputs to return as columns (default: all).

    Examples
    --------
    >>> ds = ray.data.from_numpy(images).map_batches(                 # doctest: +SKIP
    ...     Predictor, fn_constructor_kwargs={"model": "model.onnx",
    ...                                       "columns": {"image": "data"}},
    ...     concurrency=2, batch_size=256, batch_format="numpy")
    """

    def __init__(
        self,
        model: Any,
        policy: Any = None,
        device: str | None = None,
        engine: str | None = None,
        *,
        sample_inputs: Any = None,
        columns: Mapping[str, str] | None = None,
        output_names: list[str] | None = None,
    ) -> None:
        super().__init__(model, policy, device, engine, sample_inputs=sample_inputs)
        self._columns = {s.name: (columns or {}).get(s.name, s.name) for s in self.session.inputs}
        self._outputs = output_names or [s.name for s in self.session.outputs]

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        import numpy as np

        from .._errors import InvalidInputError

        missing = [column for column in self._columns.values() if column not in batch]
        if missing:
            raise InvalidInputError(
                f"Predictor: the batch lacks column(s) {missing}; it has {sorted(batch)} "
                "(map model inputs to columns with columns={input: column})"
            )
        feeds = {name: np.asarray(batch[column]) for name, column in self._columns.items()}
        outputs = self.session.run(feeds, self._outputs)
        return dict(zip(self._outputs, outputs))

"""Online serving with Ray Serve: one session per replica, requests batched."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import Any

from ._data import SessionHolder

__all__ = ["SessionServer", "deployment"]


class SessionServer(SessionHolder):
    """One replica's work: a session, and batches of requests run as one call.

    Requests (dicts of input name -> array, each with a leading batch dimension) are
    validated, concatenated along that dimension, run once, and split back; requests
    that cannot share a call (other trailing shapes or dtypes) run one by one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._names = [s.name for s in self.session.inputs]

    def run_batch(self, requests: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Outputs (name -> array) for each request, in order."""
        import numpy as np

        from .._errors import InvalidInputError

        feeds = []
        for request in requests:
            if not isinstance(request, Mapping):
                raise InvalidInputError(
                    f"a request must map input names to arrays, got {type(request).__name__}"
                )
            feeds.append({name: np.asarray(request.get(name)) for name in self._names})
        outputs = [s.name for s in self.session.outputs]
        if len(feeds) > 1 and _stackable(feeds, self._names):
            sizes = [f[self._names[0]].shape[0] for f in feeds]
            stacked = {n: np.concatenate([f[n] for f in feeds]) for n in self._names}
            try:
                results = self.session.run(stacked)
            except InvalidInputError:
                pass  # a model that declares its batch (batch 1): each request alone
            else:
                bounds = np.cumsum([0, *sizes])
                return [
                    {name: out[a:b] for name, out in zip(outputs, results)}
                    for a, b in itertools.pairwise(bounds)
                ]
        return [dict(zip(outputs, self.session.run(f))) for f in feeds]

    def check_health(self) -> None:
        """Raise when the session cannot serve (Ray Serve then replaces the replica)."""
        if self.session._engine is None:
            from .._errors import XpuRuntimeError

            raise XpuRuntimeError("the replica's session is closed")


def _stackable(feeds: list[dict[str, Any]], names: list[str]) -> bool:
    first = feeds[0]
    for f in feeds:
        for n in names:
            a, b = f[n], first[n]
            if a.ndim == 0 or a.ndim != b.ndim or a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                return False
        if len({f[n].shape[0] for n in names}) != 1:
            return False
    return True


def deployment(
    model: Any,
    policy: Any = None,
    device: str | None = None,
    engine: str | None = None,
    *,
    sample_inputs: Any = None,
    num_replicas: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_batch_size: int = 8,
    batch_wait_timeout_s: float = 0.005,
    name: str = "xpuruntime",
) -> Any:
    """A Ray Serve application serving ``model``: ``num_replicas`` replicas, one
    session each, requests batched by ``serve.batch``.

    Call it from Python through the handle (``await handle.predict.remote({"x": x})``
    returns ``{output: array}``), or over HTTP: POST ``{"inputs": {name: nested list}}``
    and receive ``{"outputs": {name: nested list}}``. ``handle.decision.remote()`` gives a
    replica's engine decision.

    Returns
    -------
    ray.serve.Application
        For ``serve.run(app)``.

    Raises
    ------
    BackendUnavailableError
        Ray Serve is not installed (``pip install xpuruntime[ray]``).
    """
    from .._errors import BackendUnavailableError

    try:
        from ray import serve
    except ImportError as e:
        raise BackendUnavailableError(
            f"Ray Serve is not installed: pip install xpuruntime[ray] ({e})"
        ) from e
    replica = serve.deployment(
        _replica_class(),
        name=name,
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    )
    return replica.bind(
        model,
        policy,
        device,
        engine,
        sample_inputs=sample_inputs,
        max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_timeout_s,
    )


@functools.cache
def _replica_class() -> type:
    """The Serve replica class (made on first use: its batching decorator is Ray's)."""
    from ray import serve

    class Replica(SessionServer):
        def __init__(
            self, *args: Any, max_batch_size: int, batch_wait_timeout_s: float, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.predict.set_max_batch_size(max_batch_size)
            self.predict.set_batch_wait_timeout_s(batch_wait_timeout_s)

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
        async def predict(self, requests: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
            return self.run_batch(requests)

        async def decision(self) -> dict[str, Any]:
            return SessionServer.decision.fget(self)

        async def __call__(self, http_request: Any) -> dict[str, Any]:
            import numpy as np

            payload = await http_request.json()
            specs = {s.name: s.dtype for s in self.session.inputs}
            inputs = payload.get("inputs", {}) if isinstance(payload, dict) else {}
            feeds = {n: np.asarray(inputs.get(n), dtype=dtype) for n, dtype in specs.items()}
            outputs = await self.predict(feeds)
            return {"outputs": {name: value.tolist() for name, value in outputs.items()}}

    return Replica

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
    validated, concatenated along that dimension, run once, and split back where that is
    checked to give each request its outputs alone, as ``run_many`` checks its batches:
    per signature (each input's trailing shape and dtype), the first batch of requests
    that differ also runs request by request (those outputs are the answers), and the
    signature is joined from then on only if every output, cut along its first axis,
    matches within rounding. Requests that cannot share a call (other trailing shapes or
    dtypes), or whose signature failed the check, run one by one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._names = [s.name for s in self.session.inputs]
        # Per signature: True (joined, checked), or why its requests run alone.
        self._joined: dict[tuple, bool | str] = {}

    @property
    def decision(self) -> dict[str, Any]:
        """The session's decision, and per request signature seen (each input's trailing
        shape and dtype) whether a batch of requests runs joined or why alone."""
        joined = {
            " ".join(
                f"{name}=Nx{'x'.join(map(str, shape))} {dtype}" for name, shape, dtype in key
            ): ("joined (checked against each request alone)" if verdict is True else verdict)
            for key, verdict in list(self._joined.items())
        }
        return {**super().decision, "joined_requests": joined}

    def run_batch(self, requests: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Outputs (name -> array) for each request, in order."""
        import numpy as np

        from .._errors import InvalidInputError, XpuRuntimeError
        from ..inference._batching import outputs_agree, same_inputs

        feeds = []
        for request in requests:
            if not isinstance(request, Mapping):
                raise InvalidInputError(
                    f"a request must map input names to arrays, got {type(request).__name__}"
                )
            feeds.append({name: np.asarray(request.get(name)) for name in self._names})
        outputs = [s.name for s in self.session.outputs]
        if len(feeds) < 2 or not _stackable(feeds, self._names):
            return [dict(zip(outputs, self.session.run(f))) for f in feeds]
        key = tuple((n, feeds[0][n].shape[1:], feeds[0][n].dtype.str) for n in self._names)
        verdict = self._joined.get(key)
        if isinstance(verdict, str):
            return [dict(zip(outputs, self.session.run(f))) for f in feeds]
        sizes = [f[self._names[0]].shape[0] for f in feeds]
        stacked = {n: np.concatenate([f[n] for f in feeds]) for n in self._names}
        if verdict is True:
            return [dict(zip(outputs, each)) for each in _cut(self.session.run(stacked), sizes)]
        alone = [self.session.run(f) for f in feeds]  # the answers; the check follows
        answers = [dict(zip(outputs, each)) for each in alone]
        if all(same_inputs(feeds[0], f) for f in feeds[1:]):
            return answers  # identical requests cannot show rows mixed: the next decides
        try:
            joined = self.session.run(stacked)
        except XpuRuntimeError as e:  # a model that declares its batch (batch 1)
            self._joined[key] = f"the model cannot run them joined: {str(e).splitlines()[0]}"
            return answers
        tolerance = self.session._batcher.tolerance
        parts = _cut(joined, sizes)
        if all(outputs_agree(p, a, tolerance) for p, a in zip(parts, alone)):
            self._joined[key] = True
        else:
            self._joined[key] = (
                "joined along the first axis, the outputs are not each request's alone "
                f"within rel_l2 {tolerance:g}"
            )
        return answers

    def check_health(self) -> None:
        """Raise when the session cannot serve (Ray Serve then replaces the replica)."""
        if self.session._engine is None:
            from .._errors import XpuRuntimeError

            raise XpuRuntimeError("the replica's session is closed")


def _cut(outputs: list[Any], sizes: list[int]) -> list[list[Any]]:
    """Each request's outputs: every output cut along its first axis into ``sizes``
    (an output that is not that long is no request's alone: left whole, it fails the
    check)."""
    bounds = list(itertools.accumulate(sizes, initial=0))
    total = bounds[-1]
    return [
        [o[a:b] if o.ndim and o.shape[0] == total else o for o in outputs]
        for a, b in itertools.pairwise(bounds)
    ]


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

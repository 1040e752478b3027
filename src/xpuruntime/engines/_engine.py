"""The Engine contract: a small class per backend; the base class owns the rest.

An adapter states which devices it runs on and which library it needs, answers
``_supports(ctx)`` for what is specific to it, builds itself in ``_build`` and runs in
``_run``. The base class checks the library and device, translates every backend
exception in the adapter's one ``_translate`` method (chaining the original), and times.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import numpy as np

from .._errors import (
    BackendUnavailableError,
    InvalidInputError,
    OutOfMemoryError,
    UnsupportedOperationError,
    XpuRuntimeError,
)
from .._model import Model
from ..kernels import Support
from ..policies import ExecutionPolicy
from ..runtime import Device, Profiler
from ._cache import EngineCache

__all__ = ["Engine", "EngineContext"]

T = TypeVar("T")


@dataclass(frozen=True)
class EngineContext:
    """What an engine is asked to run: the model, on which device, under which policy.

    ``shapes`` fixes input shapes where the caller knows them (from sample inputs);
    ``sample_inputs`` holds the caller's sample inputs, if any; ``calibration_inputs``
    the batches an engine quantizes with under ``precision="int8"``.
    """

    model: Model
    device: Device
    policy: ExecutionPolicy
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    sample_inputs: dict[str, np.ndarray] | None = field(default=None, compare=False)
    calibration_inputs: list[dict[str, np.ndarray]] | None = field(default=None, compare=False)

    def samples(self) -> dict[str, np.ndarray]:
        """Inputs to check a compiled engine with: the caller's sample inputs, else
        inputs generated from the metadata when every input is floating point.

        Raises
        ------
        InvalidInputError
            No sample inputs, and an input is not floating point: generated integers
            would be read as shapes or indices, and garbage there can crash a backend
            (OpenVINO's Col2Im does), so none are made up.
        """
        if self.sample_inputs is not None:
            return self.sample_inputs
        from .._inputs import generate_inputs

        data = [s for s in self.model.inputs if s.dtype is None or s.dtype.kind != "f"]
        if data:
            raise InvalidInputError(
                f"no sample inputs, and input {data[0].name!r} is not floating point "
                "(pass sample_inputs)"
            )
        return generate_inputs(self.model.inputs, shapes=self.shapes)

    @property
    def engine_cache(self) -> EngineCache:
        """The engine cache under the policy's cache directory."""
        return EngineCache(self.policy.resolved_cache_dir / "engines")

    @property
    def summary(self) -> dict[str, Any]:
        """What goes into the dispatch log for an engine decision."""
        return {
            "model": self.model.name,
            "model_digest": self.model.digest[:16],
            "device": str(self.device),
            "precision": self.policy.precision,
            "inputs": {s.name: list(s.shape or ()) for s in self.model.inputs},
        }


class Engine(ABC):
    """Base class of engine adapters.

    Subclasses set ``name``, ``library`` (the Python module that must import),
    ``install_hint``, ``device_kinds``, ``preference`` (rank per device kind for the
    auto order; lower goes first) and, where an int8 model's unquantized layers can
    compute in more than fp32, ``unquantized_precisions``; and implement ``_build``,
    ``_run`` and ``_translate``.
    """

    name: ClassVar[str]
    library: ClassVar[str]
    install_hint: ClassVar[str]
    device_kinds: ClassVar[tuple[str, ...]]
    preference: ClassVar[dict[str, int]] = {}
    unquantized_precisions: ClassVar[tuple[str, ...]] = ("fp32",)

    def __init__(self, ctx: EngineContext) -> None:
        self._threads_line: str | None = None
        if ctx.policy.threads == "auto":
            ctx = self._with_threads(ctx)
        self._ctx = ctx
        self._settings: dict[str, Any] = {}
        self._requests = 1
        self._judged: str | None = None
        with Profiler.instance().range(
            f"engine.build {self.name}", "engine", device=str(ctx.device)
        ):
            self._guard("load", lambda: self._build(ctx))
        # Read on every run: an engine that neither binds device memory nor always runs
        # through its bound path takes host arrays straight to ``_run``.
        self._host_only = not (self.binds_device_memory or self.always_bound)

    # -- selection ------------------------------------------------------------------------
    @classmethod
    def supports(cls, ctx: EngineContext) -> Support:
        """Can this engine run ``ctx``? Cheap: checks library, device and precision."""
        if not cls.is_installed():
            return Support.unavailable(f"{cls.library} is not installed ({cls.install_hint})")
        if ctx.device.kind not in cls.device_kinds:
            return Support.no(
                f"runs on {'/'.join(cls.device_kinds)} devices, not {ctx.device.kind}"
            )
        rest = ctx.policy.unquantized_precision
        if ctx.policy.precision in ("int8", "auto") and rest not in cls.unquantized_precisions:
            return Support.no(
                f"computes what an int8 model leaves unquantized in "
                f"{'/'.join(cls.unquantized_precisions)} only (unquantized_precision={rest})"
            )
        try:
            return cls._supports(ctx)
        except XpuRuntimeError:
            raise
        except Exception as e:
            raise cls._translate(e, "probe") from e

    @classmethod
    def _supports(cls, ctx: EngineContext) -> Support:
        return Support.yes()

    @classmethod
    def is_installed(cls) -> bool:
        """Whether the backend's Python package can be imported (without importing it)."""
        try:
            return importlib.util.find_spec(cls.library) is not None
        except (ImportError, ValueError):
            return False

    @classmethod
    def require(cls) -> Any:
        """Import and return the backend module, or raise what to install."""
        if not cls.is_installed():
            raise BackendUnavailableError(f"{cls.library} is not installed: {cls.install_hint}")
        return importlib.import_module(cls.library)

    @classmethod
    def version(cls) -> str | None:
        """The backend library's version, or None when it is not installed."""
        if not cls.is_installed():
            return None
        return str(getattr(cls.require(), "__version__", "unknown"))

    # -- running --------------------------------------------------------------------------
    @property
    def settings(self) -> dict[str, Any]:
        """What the engine was configured with (providers, precision hints, threads)."""
        settings = dict(self._settings)
        if self._threads_line is not None:
            settings["threads_auto"] = self._threads_line
        return settings

    @property
    def context(self) -> EngineContext:
        return self._ctx

    @property
    def reference_model(self) -> bytes | None:
        """The model to compute reference outputs with, when the engine runs another
        form of the session's model (a quantized one); None: the session's model."""
        return None

    def accuracy_tolerance(self, rtol: float, atol: float) -> tuple[float, float, str]:
        """``(rtol, atol, why)`` the accuracy gate applies to this engine: the gate's own
        by default; an engine whose arithmetic is coarser by design (int8) states its
        own, and why."""
        return rtol, atol, ""

    @property
    def requests(self) -> int:
        """How many requests the engine runs at once to best effect (more than 1 under
        ``performance='throughput'``): what the session's asynchronous runs keep busy."""
        return self._requests

    @property
    def judged(self) -> str | None:
        """How the engine judged its own accuracy against the fp32 model (an int8 model,
        on inputs held out from calibration), or None: the session's gate judges it."""
        return self._judged

    @property
    def binds_device_memory(self) -> bool:
        """Whether ``run`` accepts device tensors and can leave outputs on the device."""
        return False

    @property
    def always_bound(self) -> bool:
        """Whether every ``run`` must go through the bound path (CUDA-graph mode)."""
        return False

    def run(
        self, feeds: dict[str, Any], output_names: list[str], output_device: str | None = None
    ) -> list[Any]:
        """Run on validated feeds; returns arrays in ``output_names`` order: host numpy
        arrays, or device tensors (DLPack) with ``output_device='cuda'``."""
        try:  # inline rather than through _guard: this is the per-call path
            if output_device is None and self._host_only:
                return self._run(feeds, output_names)
            if output_device is None and not self.always_bound:
                # Only an engine that binds device memory can have been fed device tensors.
                if not self.binds_device_memory or all(
                    type(v) is np.ndarray for v in feeds.values()
                ):
                    return self._run(feeds, output_names)
            return self._run_bound(feeds, output_names, output_device)
        except XpuRuntimeError:
            raise
        except Exception as e:
            error = self._translate(e, "run")
            if isinstance(error, OutOfMemoryError):
                error = OutOfMemoryError(f"{error} ({_request_memory(feeds)})")
            raise error from e

    def run_batch(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Run host feeds that join several requests along the model's batch axis, past
        the size the model may declare there (``InferenceSession.run_many``'s batches):
        as ``run`` by default, which serves a dynamic batch dimension; an engine that
        compiles a form for the batch's shapes overrides ``_run_batch``."""
        try:
            return self._run_batch(feeds, output_names)
        except XpuRuntimeError:
            raise
        except Exception as e:
            raise self._translate(e, "run") from e

    def _run_batch(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        return self._run(feeds, output_names)

    def _run_bound(
        self, feeds: dict[str, Any], output_names: list[str], output_device: str | None
    ) -> list[Any]:
        """Run with device inputs or device outputs; engines that can override this."""
        raise UnsupportedOperationError(
            f"engine {self.name!r} takes host arrays and returns host arrays only"
        )

    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guard(self, action: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except XpuRuntimeError:
            raise
        except Exception as e:
            raise self._translate(e, action) from e

    def _with_threads(self, ctx: EngineContext) -> EngineContext:
        """``ctx`` with the policy's ``threads='auto'`` resolved (see
        :mod:`~xpuruntime.engines._threads`): a count, or None for the engine's default."""
        from ..runtime._discovery import usable_cores
        from ._threads import chosen_threads

        runner = None
        if ctx.device.kind != "cpu":
            line = f"{self.name}'s default (auto: tunes CPU threads only)"
        elif ctx.policy.performance == "throughput":
            line = (
                f"{self.name}'s default (auto: under performance='throughput' the engine "
                "splits the cores by requests)"
            )
        else:
            runner = self._thread_runner(ctx)
            line = f"{self.name}'s default (auto: {self.name} does not time thread counts)"
        chosen = None
        if runner is not None:
            chosen, line = chosen_threads(runner, usable_cores(), self.name)
        self._threads_line = line
        return replace(ctx, policy=ctx.policy.replace(threads=chosen))

    # -- adapter hooks --------------------------------------------------------------------
    @classmethod
    def _thread_runner(cls, ctx: EngineContext) -> Callable[[int | None], Callable[[], Any]] | None:
        """For ``threads='auto'`` on the CPU: a function that builds the model with that
        many intra-op threads (None: the engine's default) and returns a call running
        ``ctx.samples()`` once; None where the engine does not time thread counts."""
        return None

    @abstractmethod
    def _build(self, ctx: EngineContext) -> None:
        """Load/compile the model; record what was configured in ``self._settings``."""

    @abstractmethod
    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Execute once."""

    @classmethod
    @abstractmethod
    def _translate(cls, error: Exception, action: str) -> XpuRuntimeError:
        """Map a backend exception raised during ``action`` to an xpuruntime error."""


def _request_memory(feeds: dict[str, Any]) -> str:
    """The size of a request that ran out of memory, and the host's limits."""
    from ..runtime._discovery import describe_host_memory

    nbytes = sum(int(getattr(value, "nbytes", 0)) for value in feeds.values())
    return f"the request's inputs hold {nbytes / 2**30:.3f} GiB; host: {describe_host_memory()}"

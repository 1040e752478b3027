"""ExecutionPolicy: where and how an inference session runs, as data."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InvalidInputError, PolicyError, shown
from ._choices import (
    KERNEL_CHOICES,
    OPTIMIZATION_LEVELS,
    ORT_PROVIDERS,
    PRECISIONS,
    choose,
    choose_engine,
    choose_strategy,
)
from ._document import fingerprint_of, read_document, write_document
from ._kernel_policy import KernelPolicy

__all__ = ["AccuracyPolicy", "ExecutionPolicy"]

_SCHEMA = "xpuruntime.execution_policy/1"

MAX_THREADS = 1024
"""The most intra-op threads a policy may ask for (ONNX Runtime spends minutes building a
pool of 100000 threads, and fails with a binding error at 2**31)."""


@dataclass(frozen=True)
class AccuracyPolicy:
    """The accuracy an engine must reach against a reference to be used.

    An output passes when every element satisfies ``|out - ref| <= atol + rtol * |ref|``
    (numpy's ``allclose`` rule). The reference is ONNX Runtime on the CPU in fp32.

    Parameters
    ----------
    rtol, atol : float
        Relative and absolute tolerances (>= 0).
    seed : int
        Seed of the generated inputs, when the session is given no sample inputs.
    """

    rtol: float = 1e-3
    atol: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            number = _finite_float(value)
            if number is None or number < 0:
                raise PolicyError(
                    f"accuracy.{name}: expected a finite number >= 0, got {shown(value)}"
                )
            object.__setattr__(self, name, number)
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            # numpy's generators take seeds in this range (a negative one is a ValueError)
            raise PolicyError(
                f"accuracy.seed: expected an int from 0 to 2**64 - 1, got {shown(seed)}"
            )

    @classmethod
    def coerce(cls, value: AccuracyPolicy | dict[str, Any] | None) -> AccuracyPolicy | None:
        """Accept an AccuracyPolicy, a dict of its fields, or None."""
        if value is None or isinstance(value, AccuracyPolicy):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise PolicyError(
                    f"accuracy: unknown field(s) {sorted(unknown)}; expected rtol, atol, seed"
                )
            return cls(**value)
        raise PolicyError(
            f"accuracy: expected an AccuracyPolicy, a dict or None, got {type(value).__name__}"
        )


@dataclass(frozen=True)
class ExecutionPolicy:
    """Where and how an :class:`~xpuruntime.InferenceSession` runs. Immutable.

    Parameters
    ----------
    engine : str
        ``'auto'`` or an engine name: ``'onnxrt'``, ``'openvino'``, ``'tensorrt'``,
        ``'qnn'`` (aliases ``onnxruntime``, ``ort``, ``ov``, ``trt``).
    device : str
        ``'cpu'``, ``'cuda[:N]'``, ``'gpu[:N]'``, ``'npu[:N]'`` or ``'auto'``.
    precision : {'fp32', 'fp16', 'bf16', 'int8', 'default'}
        Arithmetic precision. ``fp32`` is enforced where an engine would otherwise lower
        it (OpenVINO runs bf16 on CPUs that have it; ONNX Runtime's CUDA EP uses TF32);
        ``int8`` quantizes the model to QDQ on the session's ``calibration_inputs`` (the
        ``qnn`` engine); ``default`` leaves each engine its own default.
    strict : bool
        Raise :class:`~xpuruntime.UnsupportedOperationError` instead of falling back
        when the requested engine cannot honour the policy.
    cache_dir : str or Path, optional
        Where measurements and compiled engines are cached (default: see
        :func:`xpuruntime.default_cache_dir`).
    threads : int, optional
        Intra-op threads for CPU execution (engine default when None).
    accuracy : AccuracyPolicy or dict, optional
        Gate: an engine whose outputs miss these tolerances against ONNX Runtime CPU
        fp32 is skipped (or, when strict, raises).
    auto_strategy : {'first_supported', 'best_performance'}
        How ``engine='auto'`` chooses: the first supported engine in the device's
        preference order, or the fastest, measured once and cached on disk.
    providers : sequence of {'cpu', 'cuda', 'tensorrt'}, optional
        ONNX Runtime execution providers in priority order (default: from the device).
    optimization_level : {'disable', 'basic', 'extended', 'all'}
        ONNX Runtime's graph optimisation level.
    cuda_graph : bool
        Run through a CUDA graph captured once (ONNX Runtime's CUDA-graph mode): inputs
        are copied into static device buffers and the graph is replayed. Needs a CUDA
        device, fixed input shapes (from the model or ``sample_inputs``), every node on
        the GPU, and no concurrent ``run``; a session says up front which one fails.
    kernels : KernelPolicy or dict, optional
        Kernel preferences mapped onto engine options where an engine has a matching
        knob (conv algorithm search, attention kernels, TF32, determinism, TensorRT
        tactic sources); ``explain()`` reports each as honoured or ignored.

    Examples
    --------
    >>> policy = ExecutionPolicy(engine="openvino", precision="fp32", threads=2)
    >>> policy.replace(engine="onnxrt").engine
    'onnxrt'
    """

    engine: str = "auto"
    device: str = "cpu"
    precision: str = "fp32"
    strict: bool = False
    cache_dir: str | None = None
    threads: int | None = None
    accuracy: AccuracyPolicy | None = None
    auto_strategy: str = "first_supported"
    providers: tuple[str, ...] | None = None
    optimization_level: str = "all"
    cuda_graph: bool = False
    kernels: KernelPolicy | None = None

    def __post_init__(self) -> None:
        from ..runtime._device import Device

        set_ = object.__setattr__
        set_(self, "engine", choose_engine(self.engine))
        try:
            set_(self, "device", str(Device(self.device)))
        except InvalidInputError as e:
            raise PolicyError(str(e)) from None
        set_(self, "precision", choose("precision", self.precision, PRECISIONS))
        if not isinstance(self.strict, bool):
            raise PolicyError(f"strict: expected True or False, got {shown(self.strict)}")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise PolicyError(
                    f"cache_dir: expected a path or None, got {shown(self.cache_dir)}"
                )
            cache_dir = os.fspath(self.cache_dir)
            if "\0" in str(cache_dir):
                raise PolicyError(
                    f"cache_dir: a path cannot hold a NUL byte, got {shown(cache_dir)}"
                )
            set_(self, "cache_dir", cache_dir)
        if self.threads is not None and (
            isinstance(self.threads, bool)
            or not isinstance(self.threads, int)
            or not 1 <= self.threads <= MAX_THREADS
        ):
            raise PolicyError(
                f"threads: expected an int from 1 to {MAX_THREADS} or None, got {shown(self.threads)}"
            )
        set_(self, "accuracy", AccuracyPolicy.coerce(self.accuracy))
        set_(self, "auto_strategy", choose_strategy(self.auto_strategy))
        if self.providers is not None:
            if isinstance(self.providers, str) or not hasattr(self.providers, "__iter__"):
                raise PolicyError(
                    f"providers: expected a list drawn from {list(ORT_PROVIDERS)}, "
                    f"got {shown(self.providers)}"
                )
            providers = tuple(choose("providers", p, ORT_PROVIDERS) for p in self.providers)
            if not providers or len(set(providers)) != len(providers):
                raise PolicyError(
                    f"providers: expected distinct names, got {shown(self.providers)}"
                )
            set_(self, "providers", providers)
        set_(
            self,
            "optimization_level",
            choose("optimization_level", self.optimization_level, OPTIMIZATION_LEVELS),
        )
        if not isinstance(self.cuda_graph, bool):
            raise PolicyError(f"cuda_graph: expected True or False, got {shown(self.cuda_graph)}")
        if isinstance(self.kernels, KernelPolicy):  # a private copy: KernelPolicy is mutable
            set_(self, "kernels", KernelPolicy.from_dict(self.kernels.to_dict()))
        elif isinstance(self.kernels, dict) and set(self.kernels) <= set(KERNEL_CHOICES):
            set_(self, "kernels", KernelPolicy(**self.kernels))  # the short form: op -> kernel
        elif isinstance(self.kernels, dict):
            set_(self, "kernels", KernelPolicy.from_dict(self.kernels, source="kernels"))
        elif self.kernels is not None:
            raise PolicyError(
                f"kernels: expected a KernelPolicy, a dict or None, got {type(self.kernels).__name__}"
            )

    @property
    def resolved_cache_dir(self) -> Path:
        """``cache_dir`` if set, else the default cache directory."""
        from .._files import default_cache_dir

        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def replace(self, **changes: Any) -> ExecutionPolicy:
        """A copy with ``changes`` applied (validated like the constructor)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise PolicyError(f"unknown field(s) {sorted(unknown)}; expected {_field_names()}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The canonical, JSON-ready form (with a schema version)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["accuracy"] = None if self.accuracy is None else dataclasses.asdict(self.accuracy)
        data["providers"] = None if self.providers is None else list(self.providers)
        data["kernels"] = None if self.kernels is None else self.kernels.to_dict()
        data["schema"] = _SCHEMA
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> ExecutionPolicy:
        """Build a policy from :meth:`to_dict` output; ``source`` names it in errors."""
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        schema = data.pop("schema", _SCHEMA)
        if schema != _SCHEMA:
            raise PolicyError(f"{source}: schema {shown(schema)} is not {shown(_SCHEMA)}")
        unknown = set(data) - set(_field_names())
        if unknown:
            raise PolicyError(
                f"{source}: unknown field(s) {sorted(unknown)}; expected {_field_names()}"
            )
        try:
            return cls(**data)
        except PolicyError as e:
            raise PolicyError(f"{source}: {e}") from None

    def save(self, path: str | os.PathLike[str], format: str | None = None) -> Path:
        """Write the policy atomically as JSON or YAML (by ``format`` or the suffix)."""
        return write_document(path, self.to_dict(), format)

    @classmethod
    def load(cls, path: str | os.PathLike[str], format: str | None = None) -> ExecutionPolicy:
        """Read a policy written by :meth:`save` (or by hand, in JSON or YAML)."""
        return cls.from_dict(read_document(path, format), source=str(path))

    def fingerprint(self) -> str:
        """A stable hash of the canonical form (``cache_dir`` excluded: it moves no result)."""
        data = self.to_dict()
        del data["cache_dir"]
        return fingerprint_of(data)


def _finite_float(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a real number or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return number if math.isfinite(number) else None


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ExecutionPolicy)]

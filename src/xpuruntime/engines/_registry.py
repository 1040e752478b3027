"""EngineRegistry: the engines known to this process, selected through the Dispatcher."""

from __future__ import annotations

from typing import Any

from ..kernels import Decision, KernelRegistry, MeasurementCache, dispatcher, registry
from ._engine import Engine, EngineContext

__all__ = ["EngineRegistry", "engines"]

OP = "engine"


class EngineRegistry:
    """Engine classes, registered under the dispatcher's ``"engine"`` op.

    The auto order for a device kind sorts engines by their ``preference`` rank for it.
    """

    def __init__(self, kernels: KernelRegistry) -> None:
        self._kernels = kernels

    def register(self, engine_cls: type[Engine]) -> type[Engine]:
        """Add an engine class (usable as a decorator)."""
        self._kernels.register(OP, engine_cls, replace=True)
        return engine_cls

    @property
    def names(self) -> list[str]:
        return self._kernels.names(OP)

    def get(self, name: str) -> type[Engine]:
        return self._kernels.get(OP, name)

    def order(self, device_kind: str) -> list[str]:
        """Engine names that run on ``device_kind``, most preferred first."""
        engines = [e for e in self._kernels.candidates(OP) if device_kind in e.device_kinds]
        return [e.name for e in sorted(engines, key=lambda e: e.preference.get(device_kind, 99))]

    def select(self, ctx: EngineContext, **options: Any) -> Decision:
        """Choose an engine for ``ctx`` (see :meth:`Dispatcher.select` for ``options``)."""
        options.setdefault("order", self.order(ctx.device.kind))
        return dispatcher.select(OP, ctx, **options)

    def measurement_cache(self, ctx: EngineContext) -> MeasurementCache:
        return MeasurementCache(ctx.policy.resolved_cache_dir / "engine-selection")


engines = EngineRegistry(registry)

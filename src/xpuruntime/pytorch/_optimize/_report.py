"""What :func:`~xpuruntime.pytorch.optimize` changed in a model, how to undo it (one
log, played back), and the findings its patterns report."""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..._errors import UnsupportedOperationError
from ...policies import KernelPolicy
from .._selection._policy import clear_kernel_policy, get_kernel_policy, set_kernel_policy

__all__ = ["Finding", "OptimizationReport"]

# The reports whose optimize() set a policy and that are not reverted yet, oldest first
# (weakly: a report dropped unreverted leaves its policy in force, and its model free):
# reverting one out of order hands its previous policy to the one set after it.
_SETTERS: list[weakref.ref[OptimizationReport]] = []


@dataclass(frozen=True)
class Finding:
    """One kind of thing a pattern reports: the report's attribute that lists it, its
    count's label in the summary (after ``verb``), the line each item gets, and ``doc``,
    what the list holds in one line (the docs' list of the report's fields is made from
    it)."""

    field: str
    label: str
    line: str
    verb: str = "fused"
    listed_when_empty: bool = True  # in the summary even at 0 (the report's text of old)
    triton: bool = False  # what it binds runs on our Triton kernels
    when: str | None = None  # what it binds takes effect only then ("under torch.compile")
    doc: str = ""


class OptimizationReport:
    """What :func:`optimize` changed in a model, and how to undo it.

    Attributes
    ----------
    replaced : list of (str, str, str)
        (module path, original class, new class) for each module replaced.
    skipped : list of (str, str)
        (module path, reason) for each module considered and left alone.
    each finding's field : list of str
        One list per finding of the patterns (``fused_residuals``, ``fused_swiglus``,
        ``joined_projections``, ``fused_loras``, ...: ``patterns.FINDINGS``, each with
        its one-line ``doc``; the docs' training guide lists them), by module path.
    attention : str
        How the model's attention is routed under the policy.
    policy : KernelPolicy or None
        The policy set by :func:`optimize` (None when it was called without one).

    The finding lists are the patterns' (``patterns/``): their order is the summary's.
    """

    def __init__(self, findings: tuple[Finding, ...]) -> None:
        self.replaced: list[tuple[str, str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.attention = ""
        self.policy: KernelPolicy | None = None
        self._findings = findings
        self._found: dict[str, list[str]] = {f.field: [] for f in findings}
        self._undo: list[Callable[[], None]] = []  # played back in reverse by revert()
        self._kept: list[tuple[str, _Kept]] = []  # the swapped-out modules, by path
        self._previous_policy: KernelPolicy | None = None
        # Shared with optimize()'s table of optimized models, which must not hold the
        # report itself (its undo log holds the model).
        # `joined`: the layers that run as one GEMM (weakly: FSDP2's FP8 gathers give a
        # joined GEMM's weights one scale, xpt.distributed.shard).
        self.status = SimpleNamespace(reverted=False, joined=[])
        # (device, why) where the model's device cannot run our Triton kernels.
        self.triton_missing: tuple[str, str] | None = None

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
        ``now``. ``old`` is kept for :meth:`revert` as :class:`_Kept` keeps it."""
        self.replaced.append((path, was, now))
        kept = _Kept(old, getattr(parent, name))
        self._kept.append((path, kept))
        self.on_revert(lambda: setattr(parent, name, kept.restored()))

    @property
    def reverted(self) -> bool:
        """Whether :meth:`revert` has run."""
        return self.status.reverted

    def revert(self) -> None:
        """Put every original module and forward back, and the kernel policy from before;
        drop the frozen weights' casts kept between steps.

        Raises
        ------
        UnsupportedOperationError
            The model was sharded by FSDP2 after ``optimize`` (nothing is changed):
            FSDP2 gathers the parameters into the modules ``optimize`` put in place,
            so the originals cannot run again.
        """
        if self.status.reverted:
            return
        sharded = [path for path, kept in self._kept if kept.sharded]
        if sharded:
            more = f" and {len(sharded) - 1} more module(s)" if len(sharded) > 1 else ""
            raise UnsupportedOperationError(
                f"revert: {sharded[0]}{more} sharded by FSDP2 after optimize; FSDP2 gathers "
                "the parameters into the modules optimize put there, so the originals "
                "cannot run again. Revert before sharding; xpt.clear_kernel_policy() alone "
                "removes the policy"
            )
        for undo in reversed(self._undo):
            undo()
        from .._ops._infra._frozen_casts import forget_frozen_casts

        forget_frozen_casts()
        if self.policy is not None:
            self._restore_policy()
        self.status.reverted = True

    def set_policy(self, policy: Any) -> None:
        """Set ``policy`` process-wide until :meth:`revert`."""
        previous = get_kernel_policy()
        self.policy = set_kernel_policy(policy)
        self._previous_policy = previous
        _SETTERS.append(weakref.ref(self))

    def _restore_policy(self) -> None:
        """The policy from before this report's, unless a later ``optimize`` set one
        that is still in force: that one then restores this one's previous policy."""
        at = next((i for i, ref in enumerate(_SETTERS) if ref() is self), None)
        if at is None:
            return
        del _SETTERS[at]
        if at < len(_SETTERS):  # a later report's policy stays in force
            later = _SETTERS[at]()
            if later is not None:
                later._previous_policy = self._previous_policy
        elif self._previous_policy is None:
            clear_kernel_policy()
        else:
            set_kernel_policy(self._previous_policy)

    def __str__(self) -> str:
        return "\n".join([self._summary(), *_grouped(self._lines())])

    def _unfused(self, f: Finding) -> bool:
        """Whether ``f``'s items run PyTorch's kernels on the model's device."""
        return f.triton and self.triton_missing is not None and bool(self._found[f.field])

    def _summary(self) -> str:
        """What runs now, in groups of one verb; what runs PyTorch's kernels on this
        device; then what takes effect only in a mode (``Finding.when``)."""
        now: list[tuple[str, list[str]]] = []
        unfused: list[str] = []
        later: dict[str, list[tuple[str, list[str]]]] = {}
        for f in self._findings:
            if not (f.listed_when_empty or self._found[f.field]):
                continue
            text = f"{len(self._found[f.field])} {f.label}"
            if self._unfused(f):  # its lines say so; a mode's finding is then moot
                if f.when is None:
                    unfused.append(text)
                continue
            groups = now if f.when is None else later.setdefault(f.when, [])
            if groups and groups[-1][0] == f.verb:  # consecutive findings share a verb
                groups[-1][1].append(text)
            else:
                groups.append((f.verb, [text]))
        parts = [f"replaced {len(self.replaced)} module(s)"]
        parts += [f"{verb} {_listed(texts)}" for verb, texts in now]
        if unfused:
            parts.append(
                f"left {_listed(unfused)} to PyTorch's kernels on {self.triton_missing[0]}"
            )
        parts.append(f"skipped {len(self.skipped)}")
        modes = [
            f"{when}: {', '.join(f'{verb} {_listed(texts)}' for verb, texts in groups)}"
            for when, groups in later.items()
        ]
        return "; ".join([", ".join(parts), *modes])

    def _lines(self) -> list[str]:
        lines = [f"  {path}: {old} -> {new}" for path, old, new in self.replaced]
        for f in self._findings:
            where = ""
            if self._unfused(f):
                where = f" where Triton runs; on {self.triton_missing[0]}, PyTorch's kernels"
            lines += [f"  {f.line.format(item)}{where}" for item in self._found[f.field]]
        lines += [f"  {path}: skipped, {why}" for path, why in self.skipped]
        if any(self._unfused(f) for f in self._findings):
            device, why = self.triton_missing
            lines.append(f"{device}: {why}")
        return [*lines, f"attention: {self.attention}"]


_INDEX = re.compile(r"\.(\d+)(?=[.:])")  # a layer's index in a module path


def _grouped(lines: list[str]) -> list[str]:
    """``lines`` with the lines that differ only in one layer index as one, the indices
    as ranges (``model.layers.{0-15}.mlp: ...``), in the order of their first line."""
    groups: dict[str, list[int]] = {}
    for line in lines:
        match = _INDEX.search(line)
        if match is None:
            groups.setdefault(line, [])
        else:
            key = f"{line[: match.start()]}.\0{line[match.end() :]}"
            groups.setdefault(key, []).append(int(match.group(1)))
    grouped = []
    for key, indices in groups.items():
        shown = _ranges(indices) if len(indices) < 2 else f"{{{_ranges(indices)}}}"
        grouped.append(key.replace("\0", shown))
    return grouped


def _ranges(indices: list[int]) -> str:
    """``0-3, 5`` for [0, 1, 2, 3, 5]."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _listed(texts: list[str]) -> str:
    return texts[0] if len(texts) == 1 else f"{', '.join(texts[:-1])} and {texts[-1]}"


class _Kept:
    """A swapped-out module kept for a revert without holding what it shares with the
    module in its place: its parameters and buffers (the same objects).

    FSDP2 puts a sharded parameter in the new module's place and frees the whole one
    once nothing else holds it; a module kept with its weights would hold them whole
    (the swapped layers of an 8B model: 9 GiB a rank of fp32 weights). So the original
    is held weakly (it lives on only where the caller holds it), beside a copy of it
    without those tensors (:func:`.._functional._modules.share`'s fresh registries). A
    revert gives back the original where it lives, else the copy, holding what the new
    module holds then: the trained or sharded tensors, not those of the swap."""

    def __init__(self, old: nn.Module, new: nn.Module) -> None:
        from .._functional._modules import share

        self._old, self._new, self._copy = weakref.ref(old), new, share(type(old), old)
        self._lent: list[tuple[str, str, str]] = []  # (registry, the old name, the new)
        for registry in ("_parameters", "_buffers"):
            theirs = {id(t): n for n, t in getattr(new, registry).items() if t is not None}
            ours = getattr(self._copy, registry)
            for name, tensor in ours.items():
                if tensor is not None and id(tensor) in theirs:
                    self._lent.append((registry, name, theirs[id(tensor)]))
                    ours[name] = None

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 sharded the new module's parameters (DTensors in its place)."""
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in self._new._parameters.values())

    def restored(self) -> nn.Module:
        """The module to put back, given the new module's tensors of what it lent."""
        module = self._old()
        module = self._copy if module is None else module
        for registry, ours, theirs in self._lent:
            getattr(module, registry)[ours] = getattr(self._new, registry)[theirs]
        return module

"""A frozen LoRA base stored once in FP8 (the policy's ``fp8_base``): every fused LoRA
layer's base weight becomes an :class:`~..._ops._infra._fp8_weight.Fp8Weight` (e4m3, a
scale per output row), a group stored as one tensor (q/k/v, gate and up: the
``projections`` pattern's) quantized as one, so that the joined FP8 GEMM reads it
without a copy. ``revert`` puts back dense weights of the stored (rounded) values.

Refused before anything changes, with the reason: without ``precision='fp8'`` (or
``'fp8_rowwise'``) no FP8 GEMM would read the stored base, which would then be
dequantized on every call; on a device without FP8 GEMMs. Under ``strict`` a refusal
raises (``PolicyError``, ``BackendUnavailableError``); otherwise the bases stay as they
are and the report says why."""

from __future__ import annotations

import torch
from torch import nn

from ...._errors import BackendUnavailableError, PolicyError
from ..._kernels.fp8 import PRECISIONS
from ..._linear_view import linear_view
from .._report import Finding
from .._run import Run

STORED = Finding(
    "fp8_bases",
    "frozen LoRA base weight(s) in FP8",
    "{}: its frozen base weight stored in FP8 (e4m3, a scale per output row)",
    "stored",
    listed_when_empty=False,
    doc="fused LoRA layers whose frozen base weight is stored in FP8 (``fp8_base``); ``revert`` gives back dense weights of the rounded values",
)  # fmt: skip


class Fp8Base:
    findings = (STORED,)

    def enabled(self, run: Run) -> bool:
        """Whether bases are to be stored; asked before any pattern runs, so that a
        refusal under ``strict`` raises with the model untouched."""
        return fp8_option_enabled(run, "fp8_base", _NEEDS)

    def apply_model(self, run: Run) -> None:
        why = fp8_option_refusal(run, "fp8_base", _NEEDS)
        if why is not None:
            run.skip("<model>", f"fp8_base: {why}; the LoRA bases stay as they are")
            return
        layers = []  # (path, base layer) of the fused LoRA layers whose base can be stored
        plain = []  # the same of layers without an adapter in a fused group
        taken = set()  # the LoRA bases' ids
        for path, module in run.model.named_modules():
            view = linear_view(module)
            if view is None or id(view.base) not in run.joined:
                continue
            refused = _unstorable(view.base.weight)
            if view.plain:  # (a LoRA layer's own base is met through it, first)
                if not refused and id(view.base) not in taken:
                    plain.append((path, view.base))  # (stored with its group, below)
            elif refused is not None:
                run.skip(path, f"fp8_base: {refused}; its base stays as it is")
            else:
                layers.append((path, view.base))
                taken.add(id(view.base))
        if not layers:
            run.skip("<model>", "fp8_base: no fused LoRA layer has a base to store (it "
                     "stores frozen LoRA bases; other layers keep their weights)")  # fmt: skip
        # A layer peft left without an adapter (q and v adapted, k not) is joined with
        # its group's bases in one tensor: it is stored with them, as the GEMM reads
        # the group whole.
        shared = {base.weight.untyped_storage().data_ptr() for _, base in layers}
        layers += [(p, b) for p, b in plain if b.weight.untyped_storage().data_ptr() in shared]
        for group in _groups(layers):
            _store(run, group)


_NEEDS = "the FP8 GEMMs read a stored base; under precision={!r} it would be dequantized on every call"  # fmt: skip


def fp8_option_enabled(run: Run, option: str, needs: str) -> bool:
    """Whether the policy turns the FP8 ``option`` on; under ``strict`` a refusal
    (:func:`fp8_option_refusal`) raises here, before any pattern changes the model."""
    if run.policy is None or not getattr(run.policy, option):
        return False
    fp8_option_refusal(run, option, needs)
    return True


def fp8_option_refusal(run: Run, option: str, needs: str) -> str | None:
    """Why the policy's FP8 ``option`` does nothing for ``run``'s model (None where it
    may act), found once per run: a precision other than FP8 (``needs``, formatted with
    it, says why the option needs FP8), or a device of the model's without FP8.

    Raises
    ------
    PolicyError, BackendUnavailableError
        Under ``strict``, for the precision and the device respectively.
    """
    why, error = run.memo(f"{option} refusal", lambda: _refusal(run, needs))
    if why is not None and run.policy.strict:
        raise error(f"optimize: {option}: {why} (strict mode)")
    return why


def _refusal(run: Run, needs: str) -> tuple[str | None, type[Exception]]:
    from ..._kernels.fp8 import fp8_refusal as device_refusal

    precision = run.policy.precision
    if precision not in PRECISIONS:
        why = needs.format(precision)
        return f"needs precision='fp8' or 'fp8_rowwise' ({why})", PolicyError
    devices = {p.device for p in run.model.parameters() if p.device.type != "meta"}
    for device in sorted(devices, key=str):
        why = device_refusal(device)
        if why is not None:
            return why, BackendUnavailableError
    return None, BackendUnavailableError


def _unstorable(weight: torch.Tensor) -> str | None:
    """Why ``weight`` is not stored in FP8 (None where it is)."""
    if type(weight) is not nn.Parameter or type(weight.data) is not torch.Tensor:
        return f"a {type(weight).__name__} weight (a 4-bit, sharded or already stored one)"
    if weight.requires_grad:
        return "its base weight trains"
    if weight.is_meta:
        return "a meta weight (no values to store)"
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dim() != 2:
        return f"a {weight.dim()}-D {weight.dtype} weight (FP8 storage takes 2-D float ones)"
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        return f"a {tuple(weight.shape)} weight (FP8 GEMMs need both sizes divisible by 16)"
    return None


def _groups(layers: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """``layers`` grouped by the storage of their weights (a joined group's share one),
    each group in the order of its rows."""
    by_storage: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, base in layers:
        key = base.weight.untyped_storage().data_ptr()
        by_storage.setdefault(key, []).append((path, base))
    groups = []
    for members in by_storage.values():
        members.sort(key=lambda item: item[1].weight.data_ptr())
        groups.append(members)
    return groups


def _store(run: Run, group: list[tuple[str, nn.Module]]) -> None:
    from ..._ops._infra._fp8_weight import store_fp8

    bases = [base for _, base in group]
    dtypes = [base.weight.dtype for base in bases]
    for base, weight in zip(bases, store_fp8([base.weight for base in bases])):
        base.weight = weight  # (the written weight freed: nothing here keeps it)
    run.report.add(STORED, [path for path, _ in group])
    run.report.on_revert(lambda: _dense_again(bases, dtypes))


def _dense_again(bases: list[nn.Module], dtypes: list[torch.dtype]) -> None:
    """Each base's weight a dense frozen parameter again, of the stored values."""
    for base, dtype in zip(bases, dtypes):
        values = base.weight.dequantize(dtype)
        base.weight = nn.Parameter(values, requires_grad=False)


PATTERN = Fp8Base()

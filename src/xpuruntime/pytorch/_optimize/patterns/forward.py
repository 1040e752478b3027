"""A module's own forward, copied and bound on the instance, in which the statements of
each enabled kind (:data:`.STATEMENTS`) call their op and ``apply_rotary_pos_emb`` is
the ``rope`` op (:mod:`.rope`): one rewrite per module for every kind
(:func:`.._statements.rewritten_forward`), where any of it is worth it. Each kind judges
what its statements involve (a norm, a linear layer and a GELU, layers of one input);
its helper runs anything else as written."""

from __future__ import annotations

from torch import nn

from .._probes import ROPE_FUNCTION
from .._run import Run
from .._statements import rewritten_forward


class RewrittenForward:
    def __init__(self, statements: tuple, rope, mask) -> None:
        self.statements = statements
        self.rope = rope
        self.mask = mask
        self.findings = tuple(f for part in (*statements, rope, mask) for f in part.findings)

    def enabled(self, run: Run) -> bool:
        return True  # which kinds apply is asked per module

    def apply(self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module) -> bool:
        kinds = [s for s in self.statements if s.takes(run, module)]
        rope = self.rope.match(run, path, module)
        mask = self.mask.match(run, path, module)
        names = {ROPE_FUNCTION: rope} if rope else {}
        if mask:
            names.update(mask)
        helpers = {s.kind: s.helper for s in kinds}
        match = rewritten_forward(module, helpers, names or None)
        if match is None:
            return False
        forward, found = match
        accepted = [(s, s.accept(run, module, path, found.get(s.kind, []))) for s in kinds]
        if not (any(items for _, items in accepted) or rope or mask):
            return False
        if mask:  # the same rewrite, its masks built knowing the positions are its own
            made = rewritten_forward(
                module, helpers, {**names, **self.mask.for_own_positions(mask)}
            )
            forward = self.mask.bound(run, path, module, forward, made and made[0], mask)
        run.bind(module, forward)
        for statement, items in accepted:
            run.report.add(statement.findings[0], items)
        if rope:
            run.report.add(self.rope.findings[0], [path])
        for finding in self.mask.found(run, mask) if mask else ():
            run.report.add(finding, [path])
        return False

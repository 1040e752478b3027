"""The language-model head (an ``nn.Linear`` named ``lm_head`` or tied to an embedding)
becomes a :class:`LinearCrossEntropyHead`, whose logits ``F.cross_entropy`` computes
without materialising them (:func:`ops.fused_linear_cross_entropy`) unless the policy's
``cross_entropy`` is ``torch``; any other use of the logits materialises them.

The head's parent (the ``...ForCausalLM``) gets a copy of its forward split at the
head's call (:func:`.._split.split_forward`): under torch.compile, training, the head
and what follows it, the loss, run outside the compiled graph, so that the logits stay deferred
and the loss fused there too, where the graph would compute both."""

from __future__ import annotations

import os

from torch import nn

from .._functions import bound_on_instance
from .._report import Finding
from .._run import Run
from .._split import split_forward

OUTSIDE = Finding(
    "heads_outside_the_graph",
    "head(s) and loss outside the graph",
    "{}: under torch.compile, with gradients on, its head and what follows it (the "
    "loss) run outside the graph, the logits deferred and the loss fused (one graph "
    "break; under fullgraph=True or without gradients the graph computes them as "
    "written)",
    verb="kept",
    listed_when_empty=False,
    when="under torch.compile",
    doc="models whose LM head and loss run outside the torch.compile graph, the loss fused",
)


class Head:
    findings = (OUTSIDE,)

    def enabled(self, run: Run) -> bool:
        return run.triton

    def apply(self, run: Run, path: str, parent: nn.Module, name: str, module: nn.Module) -> bool:
        why = run.memo(_heads, lambda: _heads(run.model)).get(path)
        if why is None:
            return False
        if not run.fuses("cross_entropy"):
            named = run.policy is not None and run.policy.get("cross_entropy") == "torch"
            run.skip(path, "the policy's cross_entropy is 'torch'" if named else
                     "left as written (see <model>)")  # fmt: skip
            return True
        from ..._functional._lm_head import LinearCrossEntropyHead

        run.swap(path, parent, name, LinearCrossEntropyHead(module), f"Linear ({why})",
                 "LinearCrossEntropyHead")  # fmt: skip
        split = split_forward(parent, name)
        owner = path.rsplit(".", 1)[0] if "." in path else "<model>"
        if split is None:
            run.skip(owner, _not_split(parent, name))
        else:
            run.bind(parent, split)
            run.report.add(OUTSIDE, [owner])
        return True


def _not_split(parent: nn.Module, name: str) -> str:
    """Why ``parent``'s forward is not split at its head, and what that costs."""
    if bound_on_instance(parent):
        bound = getattr(parent.forward, "__func__", parent.forward)
        code = getattr(bound, "__code__", None)  # functools.wraps hides TRL's __module__
        if code is not None and f"{os.sep}trl{os.sep}" in code.co_filename:
            return (
                "its forward is TRL's, bound on the instance by SFTTrainer: TRL computes "
                "the loss from the hidden states and the head's weight itself, in chunks, "
                "without the logits; under torch.compile that runs inside the graph as TRL "
                "writes it (no graph break; the logits are never built either way)"
            )
        return (
            f"its forward is bound on the instance already, so it is not split at {name}: "
            "under torch.compile the graph computes the logits and the loss as that "
            "forward writes them"
        )
    return (
        f"its forward is not split at {name}: under torch.compile the graph computes the "
        "logits and the loss as written"
    )


def _heads(model: nn.Module) -> dict[str, str]:
    """Path -> why it is taken for a language-model head: an ``nn.Linear`` named
    ``lm_head`` or tied to an ``nn.Embedding`` of the model."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {}
    for path, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if path.rsplit(".", 1)[-1] == "lm_head":
            heads[path] = "named lm_head"
        elif id(module.weight) in embeddings:
            heads[path] = "its weight is tied to an embedding"
    return heads


PATTERN = Head()

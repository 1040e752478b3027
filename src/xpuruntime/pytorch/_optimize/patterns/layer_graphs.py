"""CUDA graphs per decoder layer (the policy's ``graph_layers``): each layer's forward,
as the other patterns left it, becomes a
:class:`~..._graphs.layers.GraphedLayer`, which replays graphs of the layer's
forward and backward in training calls."""

from __future__ import annotations

from .._report import Finding
from .._run import Run

GRAPHED = Finding(
    "graphed_layers",
    "layer(s) replaying CUDA graphs in training",
    "{}: in training calls on a CUDA device, its forward and backward replay CUDA graphs "
    "captured at the first call of each input signature",
    verb="graphed",
    listed_when_empty=False,
    doc="decoder layers that replay CUDA graphs of their forward and backward in training "
    "(``graph_layers``)",
)


class GraphedLayers:
    findings = (GRAPHED,)

    def enabled(self, run: Run) -> bool:
        return run.policy is not None and run.policy.graph_layers

    def apply_model(self, run: Run) -> None:
        from ..._graphs.layers import GraphedLayer, LayerGraphs

        device = next((p.device for p in run.model.parameters()), None)
        if device is None or device.type != "cuda":
            run.skip("<model>", f"graph_layers: the model is on {device}; CUDA graphs need "
                     "its parameters on a CUDA device (move it before optimize)")  # fmt: skip
            return
        layers = run.decoder_layers()
        if not layers:
            run.skip("<model>", "graph_layers: no decoder layer (a transformers "
                     "GradientCheckpointingLayer) to graph")  # fmt: skip
            return
        shared = LayerGraphs()
        for path, module in layers:
            written = module.__dict__.get("forward")
            if isinstance(written, GraphedLayer):  # (optimized before: graphed already)
                continue
            module.forward = GraphedLayer(module, module.forward, path, shared)
            run.report.on_revert(lambda m=module, w=written: _restore(m, w))
        run.report.add(GRAPHED, [path for path, _ in layers])


def _restore(module, written) -> None:
    if written is None:
        del module.forward
    else:
        module.forward = written


PATTERN = GraphedLayers()

"""CUDA graphs per decoder layer (the policy's ``graph_layers``): each layer's forward,
as the other patterns left it, becomes a
:class:`~..._graphs.layers.GraphedLayer`, which replays graphs of the layer's
forward and backward in training calls. Without them, a model on a CUDA device gets a
:class:`~..._graphs.waits.HostWaits` watch over a few training steps, which says once
where the loop waits on its host (what the graphs would take out)."""

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
WATCHED = Finding(
    "watched_layers",
    "layer(s) watched for host waits",
    "{}: in training steps 3-4, whether its backward finds the GPU waiting on the host (a "
    "warning names graph_layers where it does; the layer then gets its forward back)",
    verb="watched",
    listed_when_empty=False,
    doc="decoder layers whose training steps 3-4 are watched for a backward waiting on "
    "the host, without ``graph_layers`` on a CUDA device",
)


class GraphedLayers:
    findings = (GRAPHED, WATCHED)

    def enabled(self, run: Run) -> bool:
        return True  # (graphs where the policy asks, else the watch)

    def apply_model(self, run: Run) -> None:
        from ..._graphs.layers import GraphedLayer, LayerGraphs

        device = next((p.device for p in run.model.parameters()), None)
        if run.policy is None or not run.policy.graph_layers:
            _watch(run, device)
            return
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


def _watch(run: Run, device) -> None:
    """Watch the decoder layers of a model on a CUDA device (else nothing)."""
    if device is None or device.type != "cuda":
        return
    layers = run.decoder_layers()
    if not layers:
        return
    from ..._graphs.waits import HostWaits

    run.report.on_revert(HostWaits(layers).end)
    run.report.add(WATCHED, [path for path, _ in layers])


def _restore(module, written) -> None:
    if written is None:
        del module.forward
    else:
        module.forward = written


PATTERN = GraphedLayers()

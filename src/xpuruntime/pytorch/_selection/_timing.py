"""Timing PyTorch work on its device: CUDA events around batches of calls on a GPU, the
wall clock on the CPU, in the timing loop shared with the engines
(:mod:`xpuruntime._timing`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..._timing import Comparison, sample
from ..._timing import compare_calls as compare

__all__ = ["Comparison", "compare_calls", "time_call", "time_training_call"]


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    min_iterations: int = 5,
    min_seconds: float = 0.05,
    max_iterations: int = 200,
    batch_seconds: float = 5e-3,
) -> float:
    """Median seconds per call of ``fn`` on ``device``, after ``warmup`` calls.

    On a GPU, calls are timed in batches of at least ``batch_seconds`` between one pair of
    CUDA events, so that launch gaps and the host synchronisation after each sample do
    not weigh on sub-millisecond kernels; the median is taken over the batches. The
    device idles from the first event until the host has launched the batch's first
    kernel (~0.1 ms for an op with a Python launcher): batches of ~1 ms counted that
    against such ops (measured on an H200: a 0.65 ms layer norm timed at 0.84 ms, so
    auto picked a slower kernel), batches of 5 ms make it a 2% effect.
    """
    if device.type != "cuda":
        samples = sample(
            fn,
            warmup=warmup,
            min_iterations=min_iterations,
            min_seconds=min_seconds,
            max_iterations=max_iterations,
        )
        return statistics.median(samples)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    batch = max(1, min(100, round(batch_seconds / max(_cuda_seconds(fn, 1), 1e-7))))
    samples = sample(
        fn,
        warmup=0,
        min_iterations=min_iterations,
        min_seconds=min_seconds,
        max_iterations=max_iterations,
        timer=lambda fn: _cuda_seconds(fn, batch),
    )
    return statistics.median(samples)


def time_training_call(
    run: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]],
    leaves: list[torch.Tensor],
    device: torch.device,
    *,
    backward: bool,
    grad: torch.Tensor | None = None,
    replayed: bool = False,
) -> float:
    """:func:`time_call` of ``run()`` and, with ``backward``, of the backward of its
    output by ``grad`` (ones when None), the ``leaves``' gradients cleared after each
    call as in training (no accumulation into old gradients). Where ``run()`` returns
    several tensors, the backward runs through every one that requires a gradient (by
    ones), as a model that uses them all does: through one alone, a kernel that makes
    them separately would skip the others' backward, and rank faster than it is.

    With ``replayed`` (on a GPU), the call is captured once into a CUDA graph and its
    replays are timed: what the call costs inside a captured step, where the host
    launches nothing per kernel. Eager calls of a small op are bound by the host's time
    per launch instead, so the two can rank kernels differently.
    """

    def step() -> None:
        out = run()
        if backward:
            if isinstance(out, tuple):
                outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            else:
                out.backward(torch.ones_like(out) if grad is None else grad)
            for t in leaves:
                t.grad = None

    with torch.enable_grad() if backward else torch.no_grad():
        if not replayed or device.type != "cuda":
            return time_call(step, device)
        graph = _captured(step, device)
    try:
        return time_call(graph.replay, device)
    finally:
        graph.reset()
        # No cuBLAS workspace may point into the pool reset() gives back: cuBLAS forgets
        # its per-stream workspaces and allocates them again when next needed.
        _clear_cublas_workspaces()


def _captured(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn`` captured into a CUDA graph, after two warm-up calls on the stream it is
    captured on (lazy initialisation, allocator pools and the libraries' per-stream
    workspaces settle first, outside the graph's pool). Autocast's cache of casts stays
    off while capturing: a cast cached there would outlive the graph's pool."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            with torch.cuda.graph(graph, stream=side):
                fn()
        finally:
            torch.set_autocast_cache_enabled(cached)
    torch.cuda.current_stream(device).wait_stream(side)
    return graph


_clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)


def _cuda_seconds(fn: Callable[[], object], calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / calls


def compare_calls(
    calls: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int = 7,
    min_seconds: float = 0.2,
) -> Comparison:
    """Time each callable with :func:`time_call` (at least ``min_seconds`` each) in
    ``rounds`` interleaved rounds (:func:`xpuruntime._timing.compare_calls`)."""
    return compare(calls, lambda fn: time_call(fn, device, min_seconds=min_seconds), rounds=rounds)

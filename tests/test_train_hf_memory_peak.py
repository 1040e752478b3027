"""benchmarks/train_hf.py --memory-peak: what was live at the peak of a CUDA allocator
trace, by where it was allocated (the tool that found attention holding the joined
q/k/v output; read on the CPU from a trace written by hand)."""

from benchmark_scripts import benchmark_script


def _train_hf():
    return benchmark_script("train_hf")


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def _alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": 0, "frames": []}


def test_the_peak_lists_what_was_live_then_by_its_innermost_frame_of_ours():
    torch_frame = _frame("/site/torch/nn/functional.py", 10, "linear")
    ours = _frame("/src/xpuruntime/pytorch/_ops/fp8.py", 300, "quantize")
    peft = _frame("/site/peft/tuners/lora/layer.py", 50, "forward")
    trace = [
        _alloc(1, 100, torch_frame, ours),
        _alloc(2, 300, torch_frame, peft, ours),  # peft's frame is the innermost of ours
        _alloc(3, 50, ours),
        _free(2),  # the peak (450) has passed
        _alloc(4, 200, torch_frame),  # 350 live: below the peak
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},  # not yet freed
        _free(99),  # a block allocated before the trace began
    ]
    peak, places = _train_hf().live_at_peak(trace)
    assert peak == 450
    assert places == [
        (300, 1, "layer.py:50 forward"),
        (150, 2, "fp8.py:300 quantize"),
    ]


def test_an_empty_trace_has_no_peak_and_no_places():
    assert _train_hf().live_at_peak([]) == (0, [])

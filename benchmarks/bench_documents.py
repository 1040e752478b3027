"""Attention over packed sequences: our kernel within each document against SDPA on the
block-diagonal causal mask transformers builds for a packed row (the anchor), torch's
varlen attention (``torch.nn.attention.varlen``: Unsloth runs it for packed rows from
torch 2.12; it takes the longest document's length as a host int), and SDPA's causal
attention over the whole row (what ignoring the documents would cost).

One row of T tokens (B rows), documents of equal length, bf16, forward + backward, GPU
ms per call (10 calls in a CUDA graph, replayed: the host's time not counted), and the
largest difference of our output from fp32 SDPA on the mask.

With ``--windows``, a second table: one document a row under a sliding window
(transformers' sliding-window layers: query i sees keys i - w < j <= i), ours against
SDPA on the dense window mask transformers builds (the anchor), and torch's varlen
attention with the window where its ``window_size`` takes one.

With ``--kv-heads`` fewer than ``--heads`` (grouped queries, as Gemma3-1B's 4 over 1), SDPA
takes ``enable_gqa`` and torch's varlen attention, which takes no groups on torch 2.11,
key and value heads repeated (the repeat not timed).

Usage: python benchmarks/bench_documents.py [--seq 8192] [--heads 32] [--kv-heads 32]
       [--head-dim 64] [--documents 1,2,16,64] [--windows 512,4096]
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F

from xpuruntime.pytorch._ops.flash_attention import flash_attention


def _ms(run, grad) -> float:
    """GPU ms per ``run().backward(grad)``: 10 calls captured in a CUDA graph, replayed 3
    times, so that the host's launches are not timed (over short documents each call's
    work is shorter than its host time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warmed on a side stream, as capture asks)
        for _ in range(3):
            run().backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            run().backward(grad)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=0, help="key heads (0: --heads)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--documents", default="1,2,16,64")
    parser.add_argument("--windows", default="", help="sliding windows to time, e.g. 512,4096")
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_heads = args.kv_heads or args.heads
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, B{args.batch} "
          f"H{args.heads} (key heads {kv_heads}) T{args.seq} D{args.head_dim}, bf16, "
          "fwd+bwd ms")  # fmt: skip
    print("| documents per row | SDPA, block mask | torch varlen | ours | ours vs mask | "
          "ours vs varlen | SDPA causal row | max err |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for size in (shape, (shape[0], kv_heads, *shape[2:]), (shape[0], kv_heads, *shape[2:]))
    )
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    causal_row = _ms(lambda: _sdpa(q, k, v, is_causal=True), grad)
    for count in (int(c) for c in args.documents.split(",")):
        index = torch.arange(args.seq, device="cuda")
        documents = (index * count // args.seq).expand(args.batch, -1)
        same = documents[:, None, :, None] == documents[:, None, None, :]
        mask = same & torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda").tril()
        varlen = _varlen_ms(q, k, v, grad, count)
        _row(count, q, k, v, grad, mask, varlen, causal_row, documents=documents)
        del mask, same
    if args.windows:
        print("\n| window | SDPA, window mask | torch varlen, window | ours | ours vs mask | "
              "ours vs varlen | SDPA causal row | max err |")  # fmt: skip
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        causal = torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda").tril()
        for window in (int(w) for w in args.windows.split(",")):
            mask = causal.triu(1 - window)  # (transformers' sliding_window_overlay)
            varlen = _varlen_ms(q, k, v, grad, 1, window)
            _row(window, q, k, v, grad, mask, varlen, causal_row, window=window)
            del mask


def _row(label, q, k, v, grad, mask, varlen: float | None, causal_row: float, **ours) -> None:
    """One table row: SDPA on ``mask`` (the anchor) and our kernel given ``ours``, their
    times beside ``varlen``'s and the causal row's, and our largest difference from fp32
    SDPA on the mask."""
    anchor = _ms(lambda: _sdpa(q, k, v, attn_mask=mask), grad)
    mine = _ms(lambda: flash_attention(q, k, v, True, **ours), grad)
    with torch.no_grad():
        want = _sdpa(q.float(), k.float(), v.float(), attn_mask=mask)
        error = (flash_attention(q, k, v, True, **ours).float() - want).abs().max().item()
    versus = "-" if varlen is None else f"{varlen / mine:.2f}x"
    print(f"| {label} | {anchor:.2f} | {'-' if varlen is None else f'{varlen:.2f}'} "
          f"| {mine:.2f} | {anchor / mine:.2f}x | {versus} | {causal_row:.2f} "
          f"| {error:.4f} |")  # fmt: skip


def _sdpa(q, k, v, **how):
    """SDPA, with ``enable_gqa`` where the key heads are fewer."""
    if k.shape[1] != q.shape[1]:
        how["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, **how)


def _varlen_ms(q, k, v, grad, count: int, window: int | None = None) -> float | None:
    """torch's varlen attention over the same rows, each of ``count`` equal documents
    (under a sliding ``window`` where given), on its own (B*T, H, D) leaves (no layout
    copy timed), or None where this torch has none (or no window_size for a window)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    batch, heads, seq, dim = q.shape
    length = seq // count
    group = heads // k.shape[1]  # (repeated for torch 2.11's varlen, which takes no groups)
    k, v = (t.detach().repeat_interleave(group, 1) for t in (k, v))
    flat = [t.detach().transpose(1, 2).reshape(-1, heads, dim).requires_grad_() for t in (q, k, v)]
    offsets = torch.arange(0, batch * seq + 1, length, device="cuda", dtype=torch.int32)
    taken = inspect.signature(varlen_attn).parameters  # (older torch: is_causal)
    if window is not None:
        if "window_size" not in taken:
            return None
        causal = {"window_size": (window - 1, 0)}
    else:
        causal = {"is_causal": True} if "is_causal" in taken else {"window_size": (-1, 0)}
    return _ms(
        lambda: varlen_attn(*flat, offsets, offsets, length, length, **causal),
        grad.transpose(1, 2).reshape(-1, heads, dim),
    )


if __name__ == "__main__":
    main()

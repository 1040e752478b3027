"""Our Triton attention kernel against a float64 reference, forward and backward, on the
CPU under TRITON_INTERPRET=1 (compiled on a GPU), and through fused_attention's policy."""

import re
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402
from xpuruntime.kernels import FallbackWarning  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import interpreting  # noqa: E402
from xpuruntime.pytorch._ops.flash_attention import (  # noqa: E402
    attention_backward,
    attention_forward,
    document_bounds,
    flash_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Triton's interpreter computes tl.dot on bf16 operands wrongly (triton 3.9: errors of
# 1e10 on a 16x16 product); bf16 is checked on the GPU, where the kernels are compiled.
DTYPES = [
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(
        torch.bfloat16,
        2e-2,
        2e-2,
        id="bf16",
        marks=pytest.mark.skipif(interpreting(), reason="bf16 tl.dot is wrong in the interpreter"),
    ),
]
# (batch, heads, kv_heads, seq_q, seq_k, head_dim): primes and non-powers of two, GQA,
# seq_q != seq_k both ways, every supported head_dim.
SHAPES = [
    (1, 2, 2, 37, 37, 16),
    (2, 4, 2, 50, 29, 32),
    (1, 3, 1, 29, 61, 64),
    (1, 2, 2, 67, 67, 128),
    (1, 2, 1, 45, 45, 256),
]


pytestmark = pytest.mark.usefixtures("clean_kernel_policy")


def _qkv(b, h, hkv, sq, sk, d, dtype, grad=True):
    shapes = [(b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)]
    return [torch.randn(s, device=DEVICE, dtype=dtype).requires_grad_(grad) for s in shapes]


def _reference(q, k, v, causal, documents=None, window=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if documents is not None:  # (B, 1, S, S): the same document only
            keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
        if window is not None:  # transformers' sliding_window_overlay: kv > q - window
            keep = keep & keep.new_ones(keep.shape[-2:]).triu(1 - window)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(group, 1), (q, k, v)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_matches_float64_forward_and_backward(shape, causal, dtype, atol, rtol):
    q, k, v = _qkv(*shape, dtype)
    out = flash_attention(q, k, v, is_causal=causal)
    _close_to_float64(out, q, k, v, causal, None, atol, rtol)


def _close_to_float64(out, q, k, v, causal, documents, atol, rtol, window=None):
    """``out`` and the gradients it sends to q, k, v as the float64 reference's."""
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, leaves = _reference(q, k, v, causal, documents, window)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, msg="output")
    for name, ours, theirs in zip("qkv", (q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        # Gradients reduce over the sequence (and the query heads sharing a kv head).
        torch.testing.assert_close(
            ours.double(), theirs, atol=atol * 4, rtol=rtol * 4, msg=f"d{name}"
        )


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_inputs_as_transformers_holds_them_take_no_copy_and_match_float64(packed):
    """q, k and v as views of one joined projection's (B, S, width) output, transposed
    to (B, H, S, D) as transformers' attention holds them: the output comes back laid
    out (B, S, H, D), so transformers' ``transpose(1, 2).reshape`` is a view; the
    backward copies nothing (no ``contiguous`` of the output's gradient, the input
    gradients already laid out as the views they flow back to); values as float64's."""
    b, h, hkv, s, d = 2, 4, 2, 37, 32
    sizes = [h * d, hkv * d, hkv * d]
    joined = torch.randn(b, s, sum(sizes), device=DEVICE, dtype=torch.float16)
    documents = _documents((12, 25), (30, 7)) if packed else None

    def heads(rows):
        return [p.view(b, s, -1, d).transpose(1, 2) for p in rows.split(sizes, dim=-1)]

    ours = joined.clone().requires_grad_()
    out = flash_attention(*heads(ours), is_causal=True, documents=documents)
    assert out.transpose(1, 2).is_contiguous()  # reshaped to (B, S, H * D) as a view
    grad = torch.randn(b, s, h * d, device=DEVICE, dtype=out.dtype)
    with torch.profiler.profile() as trace:
        out.transpose(1, 2).reshape(b, s, h * d).backward(grad)
    copies = [e.name for e in trace.events() if e.name in ("aten::contiguous", "aten::clone")]
    assert not copies, copies
    ref, leaves = _reference(*heads(joined), True, documents)
    ref.transpose(1, 2).reshape(b, s, h * d).backward(grad.double())
    want = torch.cat([t.grad.transpose(1, 2).reshape(b, s, -1) for t in leaves], dim=-1)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(ours.grad.double(), want, atol=8e-3, rtol=8e-3)


def test_every_output_element_is_written():
    """Outputs start as NaN: an unwritten tail row, column or head would stay NaN."""
    b, h, hkv, sq, sk, d = 2, 4, 2, 45, 53, 32
    q, k, v = _qkv(b, h, hkv, sq, sk, d, torch.float16, grad=False)
    nan = float("nan")
    o = torch.full_like(q, nan)
    lse = torch.full((b, h, sq), nan, device=DEVICE)
    attention_forward(q, k, v, True, d**-0.5, o, lse)
    do = torch.randn_like(o)
    dq, dk, dv = torch.full_like(q, nan), torch.full_like(k, nan), torch.full_like(v, nan)
    attention_backward(do, q, k, v, o, lse, True, d**-0.5, dq, dk, dv)
    for name, t in {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}.items():
        assert not t.isnan().any(), f"{name} left partly unwritten"


def test_a_custom_scale_is_applied():
    q, k, v = _qkv(1, 2, 2, 33, 33, 16, torch.float16, grad=False)
    out = flash_attention(q, k, v, scale=0.05)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=0.05
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(dtype=torch.float32), "fp16 or bf16"),
        (dict(head_dim=80), "head_dim in"),
    ],
)
def test_inputs_our_kernel_does_not_take_are_refused_with_the_reason(change, needle):
    d = change.get("head_dim", 16)
    q, k, v = _qkv(1, 2, 2, 8, 8, d, change.get("dtype", torch.float16), grad=False)
    with pytest.raises(xrt.InvalidInputError, match=needle):
        flash_attention(q, k, v)


def test_the_policy_routes_fused_attention_to_triton_and_the_log_shows_its_ops():
    q, k, v = _qkv(1, 4, 2, 40, 40, 32, torch.float16)
    xpt.enable_dispatch_logging()
    with xpt.kernel_policy(attention="triton", strict=True):
        out = xpt.ops.fused_attention(q, k, v, is_causal=True)
        out.sum().backward()
    records = [r for r in xpt.get_dispatch_logs() if r.op == "attention" and "aten_op" in r.context]
    ops = {(r.context["aten_op"], r.context["phase"]) for r in records}
    assert ops == {
        ("xpuruntime::attention", "forward"),
        ("xpuruntime::attention_backward", "backward"),
    }
    assert all(r.chosen == "triton" and r.source == "policy" for r in records)
    ref, _ = _reference(q, k, v, True)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_fused_attention_compiles_into_one_graph_around_our_kernel():
    q, k, v = _qkv(1, 4, 2, 24, 24, 16, torch.float16)
    with xpt.kernel_policy(attention="triton", strict=True):
        compiled = torch.compile(xpt.ops.fused_attention, fullgraph=True)
        out = compiled(q, k, v, is_causal=True)
        with torch.profiler.profile() as prof:
            compiled(q, k, v, is_causal=True)
    assert "xpuruntime::attention" in {e.name for e in prof.events()}
    ref, _ = _reference(q, k, v, True)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_compiled_fused_attention_refuses_unsupported_inputs_under_a_strict_triton_policy():
    q, k, v = _qkv(1, 2, 2, 16, 16, 16, torch.float32, grad=False)
    compiled = torch.compile(xpt.ops.fused_attention)
    with xpt.kernel_policy(attention="triton", strict=True):
        with pytest.raises(xrt.UnsupportedOperationError, match="fp16 or bf16"):
            compiled(q, k, v)
    with xpt.kernel_policy(attention="triton"):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(compiled(q, k, v), expected)


def test_strict_triton_on_unsupported_inputs_raises_and_non_strict_falls_back():
    q, k, v = _qkv(1, 2, 2, 16, 16, 16, torch.float32, grad=False)
    with xpt.kernel_policy(attention="triton", strict=True):
        with pytest.raises(xrt.UnsupportedOperationError, match="fp16 or bf16"):
            xpt.ops.fused_attention(q, k, v)
    mask = torch.ones(16, 16, dtype=torch.bool, device=DEVICE)
    with xpt.kernel_policy(attention="triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = xpt.ops.fused_attention(q, k, v, attn_mask=mask)
    assert any(
        issubclass(w.category, FallbackWarning) and "attn_mask" in str(w.message) for w in caught
    )
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)


def _documents(*lengths_per_row):
    """(B, S) document ids, each row's documents of the lengths given."""
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths_per_row]
    return torch.stack(rows).to(DEVICE)


# Rows of documents: one position long, crossing the interpreter's 16- and 32-row blocks,
# a whole row one document (plain causal), and two rows laid out differently.
DOCUMENTS = [
    pytest.param(((1, 30, 2, 17, 1),), 1, 1, 32, id="short-and-long"),
    pytest.param(((51,),), 2, 2, 16, id="one-document"),
    pytest.param(((20, 13, 18), (5, 40, 6)), 4, 2, 64, id="two-rows-gqa"),
    pytest.param(((16, 16, 16, 16),), 2, 1, 128, id="block-aligned"),
    # Documents of several blocks: rows and keys within one document past the diagonal
    # run unmasked, beside documents starting inside a block.
    pytest.param(((100, 37, 91), (64, 128, 36)), 2, 1, 32, id="long-documents"),
]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim", DOCUMENTS)
def test_packed_documents_attend_within_themselves_as_float64_does(
    lengths, heads, kv_heads, head_dim, dtype, atol, rtol
):
    """Packed sequences (TRL's padding-free rows): each position attends causally to its
    own document alone, forward and backward, as a float64 reference with the
    block-diagonal causal mask."""
    documents = _documents(*lengths)
    batch, seq = documents.shape
    q, k, v = _qkv(batch, heads, kv_heads, seq, seq, head_dim, dtype)
    out = flash_attention(q, k, v, is_causal=True, documents=documents)
    _close_to_float64(out, q, k, v, True, documents, atol, rtol)


# (rows' document lengths or None: one document a row, heads, kv heads, head dim, window):
# windows of one key, inside a block, across blocks, cutting documents and not.
WINDOWS = [
    pytest.param(None, 2, 1, 32, 1, id="one-key"),
    pytest.param(None, 2, 2, 16, 7, id="inside-a-block"),
    pytest.param(None, 4, 2, 64, 40, id="across-blocks-gqa"),
    pytest.param(((100, 37, 91),), 2, 1, 32, 45, id="documents-longer-than-the-window"),
    pytest.param(((20, 13, 18), (5, 40, 6)), 2, 2, 16, 300, id="window-over-every-document"),
    pytest.param(((30, 40),), 4, 1, 256, 24, id="gemma-heads-of-256"),
]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, window", WINDOWS)
def test_a_sliding_window_attends_to_its_last_keys_as_float64_does(
    lengths, heads, kv_heads, head_dim, window, dtype, atol, rtol
):
    """A sliding window (transformers' sliding-window layers: query i sees keys i - w < j
    <= i), alone or within packed documents, forward and backward, as a float64
    reference with the window's mask."""
    documents = None if lengths is None else _documents(*lengths)
    batch, seq = (2, 83) if documents is None else documents.shape
    q, k, v = _qkv(batch, heads, kv_heads, seq, seq, head_dim, dtype)
    out = flash_attention(q, k, v, is_causal=True, documents=documents, window=window)
    _close_to_float64(out, q, k, v, True, documents, atol, rtol, window)


@pytest.mark.parametrize("split", [False, True], ids=["per-key-head", "per-query-head"])
@pytest.mark.parametrize("documents", [None, ((20, 31),)], ids=["causal", "packed"])
def test_grouped_heads_key_gradients_are_float64s_whichever_way_programs_are_split(
    split, documents, monkeypatch
):
    """Four query heads over one key head (Gemma3's grouping): the key and value
    gradients by one program per key head walking its group, or by one per query head
    with the shares summed after (what a device with few programs a key head takes),
    are the float64 reference's either way."""
    from xpuruntime.pytorch._ops import flash_attention as fa

    monkeypatch.setattr(fa, "_split_groups", lambda device, programs, group: split)
    rows = None if documents is None else _documents(*documents)
    q, k, v = _qkv(2 if rows is None else 1, 4, 1, 51, 51, 32, torch.float16)
    out = flash_attention(q, k, v, is_causal=True, documents=rows, window=20)
    _close_to_float64(out, q, k, v, True, rows, 2e-3, 2e-3, window=20)


def test_window_bounds_are_each_positions_first_key_and_past_last_query():
    starts, ends = document_bounds(_documents((2, 4)), window=3)
    assert starts.tolist() == [[0, 0, 2, 2, 2, 3]]  # the document's start, or i - 2
    assert ends.tolist() == [[2, 2, 5, 6, 6, 6]]  # the document's end, or j + 3
    # A window as long as the row cuts nothing.
    assert document_bounds(_documents((6,)), window=6)[0].tolist() == [[0] * 6]


@pytest.mark.parametrize("window, needle", [(0, "positive int"), (2.0, "positive int"),
                                            (True, "positive int")])  # fmt: skip
def test_a_window_the_kernel_cannot_mask_by_is_refused_by_name(window, needle):
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float16)
    with pytest.raises(xrt.InvalidInputError, match=needle):
        flash_attention(q, k, v, is_causal=True, window=window)
    with pytest.raises(xrt.InvalidInputError, match="pass is_causal=True"):
        flash_attention(q, k, v, window=4)


def test_document_bounds_are_each_positions_first_and_past_last_position():
    starts, ends = document_bounds(_documents((2, 1, 3), (6,)))
    assert starts.tolist() == [[0, 0, 2, 3, 3, 3], [0] * 6]
    assert ends.tolist() == [[2, 2, 3, 6, 6, 6], [6] * 6]
    assert starts.dtype == ends.dtype == torch.int32


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"is_causal": False}, "pass is_causal=True"),
        ({"documents": "ids"}, "must be a Tensor"),
        ({"documents": torch.zeros(1, 24)}, "integer ids"),
        ({"documents": torch.zeros(1, 23, dtype=torch.long)}, "must be (batch, seq) = (1, 24)"),
    ],
)
def test_documents_the_kernel_cannot_mask_by_are_refused_by_name(change, needle):
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float16)
    kwargs = {"is_causal": True, "documents": torch.zeros(1, 24, dtype=torch.long), **change}
    if isinstance(kwargs["documents"], torch.Tensor):
        kwargs["documents"] = kwargs["documents"].to(DEVICE)
    with pytest.raises(xrt.InvalidInputError, match=re.escape(needle)):
        flash_attention(q, k, v, **kwargs)


def test_backward_is_deterministic():
    q, k, v = _qkv(1, 4, 1, 45, 45, 32, torch.float16)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        flash_attention(q, k, v, is_causal=True).backward(
            torch.ones(q.shape, device=DEVICE, dtype=q.dtype)
        )
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_flash_attention_traces_through_torch_compile():
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.float16)
    compiled = torch.compile(
        lambda q, k, v: flash_attention(q, k, v, True) * 2, backend="aot_eager", fullgraph=True
    )
    out = compiled(q, k, v)
    out.sum().backward()
    ref, leaves = _reference(q, k, v, True)
    (ref * 2).sum().backward()
    torch.testing.assert_close(out.double(), ref * 2, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(q.grad.double(), leaves[0].grad, atol=8e-3, rtol=8e-3)

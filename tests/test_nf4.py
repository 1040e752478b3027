"""Our Triton pass over bitsandbytes' 4-bit storage (QLoRA's base) against bitsandbytes'
own dequantize_4bit: the same weight to the bit (on the GPU, within one rounding where
the scales are double-quantized), nf4 and fp4, the scales double-quantized or not, block sizes and element counts that do not divide, written into a slice of a
joined weight; and what it does not take is said."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("triton")

from bitsandbytes import functional as bnb_functional  # noqa: E402

from xpuruntime.pytorch._ops import nf4  # noqa: E402
from xpuruntime.pytorch._ops._infra._launch import triton_unavailable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable(torch.device(DEVICE)) is not None, reason="Triton runs nothing here"
)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "plain-scales"])
@pytest.mark.parametrize(("shape", "blocksize"), [((96, 64), 64), ((37, 53), 128), ((5, 7), 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_weight_is_bitsandbytes_own_to_the_bit(quant_type, nested, shape, blocksize, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    weight = weight.to(DEVICE, dtype)
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
    )
    want = bnb_functional.dequantize_4bit(packed, state)
    got = nf4.dequantize_4bit(packed, state, torch.empty_like(want))
    assert got.dtype == want.dtype == dtype
    if DEVICE == "cuda" and nested:
        # The GPU fuses a double-quantized scale's multiply and add (one rounding where
        # bitsandbytes' two kernels have two): fp32 weights up to 2 ulp apart where they
        # differ (seen on an H200 with bitsandbytes 0.49 and 0.50), the half-precision ones
        # equal but where that rounding tips.
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=0)
    else:
        assert torch.equal(got, want)


def test_parts_are_written_into_their_rows_of_a_joined_weight():
    parts = [torch.randn(n, 40, device=DEVICE, dtype=torch.bfloat16) for n in (24, 8, 8)]
    quantized = [bnb_functional.quantize_4bit(p, quant_type="nf4") for p in parts]
    joined = torch.full((40, 40), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    for (packed, state), rows in zip(quantized, joined.split([24, 8, 8])):
        nf4.dequantize_4bit(packed, state, rows)
    want = torch.cat([bnb_functional.dequantize_4bit(p, s) for p, s in quantized])
    assert torch.equal(joined, want)


def test_what_it_cannot_make_is_said():
    weight = torch.randn(16, 16, device=DEVICE, dtype=torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(weight, quant_type="nf4")
    assert "of its size" in nf4.unsupported(packed, state, torch.empty(8, device=DEVICE))
    wrong = torch.empty(16, 16, device=DEVICE, dtype=torch.bfloat16).t()
    assert "contiguous" in nf4.unsupported(packed, state, wrong)
    with pytest.raises(Exception, match="dequantize_4bit: .*contiguous"):
        nf4.dequantize_4bit(packed, state, wrong)
    # A weight the pass would index past 32 bits (a state saying so: none is allocated).
    huge = copy.copy(state)
    huge.shape = torch.Size([2**16, 2**15])
    assert "2**31 elements or more" in nf4.unsupported(packed, huge)


def _quantized(parts: list, nested: bool) -> tuple:
    """``parts`` as bitsandbytes' nf4 ``Params4bit`` weights, quantized on the device."""
    from bitsandbytes.nn import Params4bit

    weights = (Params4bit(p, requires_grad=False, quant_type="nf4", compress_statistics=nested)
               for p in parts)  # fmt: skip
    return tuple(w.to(DEVICE) if DEVICE == "cuda" else w._quantize(DEVICE) for w in weights)


@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "plain-scales"])
def test_a_group_is_joined_by_one_launch_equal_to_bitsandbytes(nested):
    parts = [torch.randn(n, 64, dtype=torch.bfloat16) for n in (48, 16, 16)]
    weights = _quantized(parts, nested)
    want = torch.cat([bnb_functional.dequantize_4bit(w.data, w.quant_state) for w in weights])
    got = nf4.joined_4bit(weights, torch.bfloat16)
    again = nf4.joined_4bit(weights, torch.bfloat16)  # from the kept plan
    if DEVICE == "cuda" and nested:
        torch.testing.assert_close(got, want, rtol=torch.finfo(torch.bfloat16).eps, atol=0)
    else:
        assert torch.equal(got, want)
    assert torch.equal(again, got)
    assert nf4.joined_4bit(weights, torch.float16) is None  # another dtype: not this pass
    # A weight whose storage is rebound is read anew, not from the kept plan.
    (other,) = _quantized([torch.randn(48, 64, dtype=torch.bfloat16)], nested)
    weights[0].data, weights[0].quant_state = other.data, other.quant_state
    rebound = nf4.joined_4bit(weights, torch.bfloat16)
    assert torch.equal(rebound[:48], bnb_functional.dequantize_4bit(other.data, other.quant_state))


@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "plain-scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_quantized_from_fp32_are_joined_in_the_compute_dtype_as_bitsandbytes_casts(
    nested, dtype
):
    """A model loaded in fp32 and quantized so (its states' dtype fp32) computes in bf16:
    one launch writes the group in bf16 (or fp16), bitsandbytes' fp32 weights cast, not
    fp32 weights written, read and cast again by each part."""
    parts = [torch.randn(n, 64) for n in (48, 16, 16)]  # (fp32, as such a model holds them)
    weights = _quantized(parts, nested)
    assert {w.quant_state.dtype for w in weights} == {torch.float32}
    want = torch.cat([bnb_functional.dequantize_4bit(w.data, w.quant_state) for w in weights])
    got = nf4.joined_4bit(weights, dtype)
    assert got is not None and got.dtype == dtype
    if DEVICE == "cuda" and nested:  # (the fused scale's rounding, as above)
        torch.testing.assert_close(got, want.to(dtype), rtol=torch.finfo(dtype).eps, atol=0)
    else:
        assert torch.equal(got, want.to(dtype))

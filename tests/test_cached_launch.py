"""The key of a direct Triton launch: a superset of what Triton specialises a compiled
kernel on, so that a cache hit runs the binary Triton itself would have chosen."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from xpuruntime.pytorch._ops._infra._cached_launch import specialisation  # noqa: E402


def test_tensors_are_told_apart_by_dtype_and_16_byte_alignment():
    base = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned = base[:8], base[1:9]
    keys = {
        tuple(specialisation((t,)))
        for t in (aligned, misaligned, aligned.to(torch.bfloat16), base[4:12])
    }
    assert len(keys) == 3  # base[4:12] starts 16 bytes in: aligned as base[:8]


@pytest.mark.parametrize(
    "a, b",
    [(1, 2), (16, 17), (2**31 - 16, 2**31), (2**63 - 16, 2**63), (-16, -17)],
)
def test_ints_are_told_apart_where_triton_specialises(a, b):
    assert specialisation((a,)) != specialisation((b,))


def test_ints_of_one_class_share_a_key_and_floats_share_one_by_type():
    assert specialisation((32, 1e-5, None, True)) == specialisation((48, 1e-6, None, True))
    assert specialisation((True,)) != specialisation((False,))

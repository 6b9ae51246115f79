"""The bfloat16 packed-weight C++ linear layer (AVX512_BF16) against its float32-accumulator twin
(kernels/reference.py), its batch invariance, and its refusal on CPUs without AVX512_BF16."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_extension import cpu_flags
from kernels.cpu_gemm import linear_bf16_supported, linear_packed_bf16, pack_linear_weight_bf16
from kernels.reference import linear_bf16_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the CPU has no AVX512_BF16")


def _weights(out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    return weight, torch.randn(out_features, generator=gen).bfloat16()


def test_supported_exactly_when_the_cpu_has_avx512_bf16():
    assert linear_bf16_supported() == ("avx512_bf16" in cpu_flags())


@pytest.mark.skipif("avx512_bf16" in cpu_flags(), reason="the CPU has AVX512_BF16")
def test_refused_without_avx512_bf16():
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        pack_linear_weight_bf16(torch.ones(4, 4, dtype=torch.bfloat16))


@needs_bf16
def test_pack_layout_is_pairs_of_inputs_per_column_zero_padded():
    weight, _ = _weights(37, 5)

    packed = pack_linear_weight_bf16(weight)

    assert packed.shape == (2, 3, 32, 2) and packed.dtype == torch.bfloat16
    for n in range(37):
        for k in range(5):
            assert packed[n // 32, k // 2, n % 32, k % 2] == weight[n, k]
    assert torch.count_nonzero(packed[1, :, 5:].float()) == 0 and torch.count_nonzero(packed[:, 2, :, 1].float()) == 0


@needs_bf16
@pytest.mark.parametrize("num_rows", [0, 1, 2, 7, 12, 13, 25, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (37, 29), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_accumulator_rounded_once(num_rows, out_features, in_features, with_bias):
    """Equal to the exact float32 result rounded to bfloat16, up to one bfloat16 unit (relative 2 ** -7: the
    float32 sums' order differs, so a sum near a rounding boundary may round the other way) and float32
    rounding near zero."""
    weight, bias = _weights(out_features, in_features)
    bias = bias if with_bias else None
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()

    out = linear_packed_bf16(x, pack_linear_weight_bf16(weight), out_features, bias)

    assert out.shape == (num_rows, out_features) and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out.float(), linear_bf16_reference(x, weight, bias).float(), atol=1e-3, rtol=2**-7)


@needs_bf16
def test_strided_rows_and_leading_dimensions():
    weight, bias = _weights(40, 24)
    packed = pack_linear_weight_bf16(weight)
    x = torch.randn(9, 50).bfloat16()[:, 3:27]
    assert not x.is_contiguous()
    x3 = torch.randn(2, 7, 24).bfloat16()

    out, out3 = linear_packed_bf16(x, packed, 40, bias), linear_packed_bf16(x3, packed, 40)

    torch.testing.assert_close(out.float(), linear_bf16_reference(x, weight, bias).float(), atol=1e-3, rtol=2**-7)
    assert out3.shape == (2, 7, 40)
    torch.testing.assert_close(out3.float(), linear_bf16_reference(x3, weight).float(), atol=1e-3, rtol=2**-7)


@needs_bf16
def test_rows_are_batch_invariant_bit_for_bit():
    """A row's output does not depend on how many rows share the call or where it sits."""
    weight, bias = _weights(100, 96)
    packed = pack_linear_weight_bf16(weight)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(2)).bfloat16()

    full = linear_packed_bf16(x, packed, 100, bias)

    for start, stop in [(0, 1), (5, 6), (3, 17), (39, 40), (0, 13)]:
        assert torch.equal(linear_packed_bf16(x[start:stop], packed, 100, bias), full[start:stop])


@needs_bf16
def test_mismatched_input_features_raise():
    weight, _ = _weights(32, 16)
    with pytest.raises(RuntimeError, match="features"):
        linear_packed_bf16(torch.ones(2, 18, dtype=torch.bfloat16), pack_linear_weight_bf16(weight), 32)

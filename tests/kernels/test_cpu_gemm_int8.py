"""The weight-only int8 C++ linear layer against a plain torch dequantize-matmul (kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_gemm import linear_int8_packed, pack_linear_weight_int8, panel_width
from kernels.reference import linear_int8_reference, quantize_int8_per_channel

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _weights(out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)


def test_quantize_per_channel_round_trip():
    weight, _ = _weights(37, 29)
    weight[3] = 0.0
    qweight, scales = quantize_int8_per_channel(weight)
    assert qweight.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (37,)
    assert int(qweight.abs().max()) == 127 and scales[3] == 1.0 and torch.count_nonzero(qweight[3]) == 0
    # Round to nearest: every weight within half a step of its dequantized value.
    assert torch.all((qweight.float() * scales[:, None] - weight).abs() <= scales[:, None] / 2 + 1e-6)


def test_pack_layout_matches_the_float_panels():
    width = panel_width()
    qweight, _ = quantize_int8_per_channel(_weights(2 * width + 5, 5)[0])
    packed = pack_linear_weight_int8(qweight)
    assert packed.dtype == torch.int8 and packed.shape == (3, 5, width)
    for n in range(qweight.shape[0]):
        assert torch.equal(packed[n // width, :, n % width], qweight[n])
    assert torch.count_nonzero(packed[2, :, 5:]) == 0


@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 7, 12, 13, 64, 300])  # decode rows .. a prefill chunk
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (37, 29), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_dequantize_matmul(num_rows, out_features, in_features, with_bias):
    weight, bias = _weights(out_features, in_features)
    bias = bias if with_bias else None
    qweight, scales = quantize_int8_per_channel(weight)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))

    out = linear_int8_packed(x, pack_linear_weight_int8(qweight), scales, out_features, bias)

    assert out.shape == (num_rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, linear_int8_reference(x, qweight, scales, bias), atol=1e-4, rtol=1e-5)


def test_batch_invariant_and_leading_dimensions():
    qweight, scales = quantize_int8_per_channel(_weights(40, 24)[0])
    packed = pack_linear_weight_int8(qweight)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(2))
    out = linear_int8_packed(x, packed, scales, 40)
    assert out.shape == (2, 7, 40)
    for row in range(7):
        assert torch.equal(linear_int8_packed(x[0, row : row + 1], packed, scales, 40)[0], out[0, row])


def test_bad_input_is_refused():
    qweight, scales = quantize_int8_per_channel(_weights(20, 8)[0])
    packed = pack_linear_weight_int8(qweight)
    with pytest.raises(RuntimeError, match="int8"):
        pack_linear_weight_int8(qweight.float())
    with pytest.raises(RuntimeError, match="scales"):
        linear_int8_packed(torch.randn(1, 8), packed, scales[:10], 20)
    with pytest.raises(RuntimeError, match="features"):
        linear_int8_packed(torch.randn(1, 9), packed, scales, 20)

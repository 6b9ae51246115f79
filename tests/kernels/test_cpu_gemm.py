"""The packed-weight C++ linear layer against torch.nn.functional.linear, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu_gemm import linear_packed, pack_linear_weight, panel_width

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _weights(out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)


def test_pack_layout_is_transposed_panels_zero_padded():
    width = panel_width()
    assert width in (16, 32)  # two vector registers: AVX2 or AVX-512
    out_features = 2 * width + 5
    weight, _ = _weights(out_features, 5)

    packed = pack_linear_weight(weight)

    assert packed.shape == (3, 5, width)
    for n in range(out_features):
        assert torch.equal(packed[n // width, :, n % width], weight[n])
    assert torch.count_nonzero(packed[2, :, 5:]) == 0


@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 6, 7, 11, 12, 13, 25, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (37, 29), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_functional_linear(num_rows, out_features, in_features, with_bias):
    weight, bias = _weights(out_features, in_features)
    bias = bias if with_bias else None
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))

    out = linear_packed(x, pack_linear_weight(weight), out_features, bias)

    assert out.shape == (num_rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_strided_rows_and_leading_dimensions():
    """A column slice of a wider tensor (row stride > in_features) and a 3-D input both work."""
    weight, bias = _weights(40, 24)
    packed = pack_linear_weight(weight)
    wide = torch.randn(9, 50)
    x = wide[:, 3:27]
    assert not x.is_contiguous()

    torch.testing.assert_close(linear_packed(x, packed, 40, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 7, 24)
    torch.testing.assert_close(linear_packed(x3, packed, 40), F.linear(x3, weight), atol=1e-4, rtol=1e-5)


def test_rows_are_batch_invariant_bit_for_bit():
    """A row's output is identical alone, at any position of any batch, with one thread or two."""
    weight, _ = _weights(70, 96)
    packed = pack_linear_weight(weight)
    rows = torch.randn(23, 96, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([linear_packed(rows[i : i + 1], packed, 70) for i in range(23)])

    torch.set_num_threads(2)
    batched = linear_packed(rows, packed, 70)
    shuffled_order = torch.randperm(23, generator=torch.Generator().manual_seed(3))
    shuffled = linear_packed(rows[shuffled_order], packed, 70)

    assert torch.equal(batched, alone)
    assert torch.equal(shuffled, alone[shuffled_order])


def test_rows_beyond_one_row_block():
    """Wide inputs split the rows into several cache blocks (1 MiB of activations: 64 rows of 4,096
    features); every block, the last one partial, matches F.linear and the rows stay batch invariant."""
    weight, bias = _weights(40, 4096)
    packed = pack_linear_weight(weight)
    x = torch.randn(150, 4096, generator=torch.Generator().manual_seed(4))

    out = linear_packed(x, packed, 40, bias)

    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-3, rtol=1e-5)
    assert torch.equal(out[131:], linear_packed(x[131:], packed, 40, bias))


def test_mismatched_shapes_raise():
    weight, _ = _weights(32, 16)
    packed = pack_linear_weight(weight)

    with pytest.raises(RuntimeError, match="features"):
        linear_packed(torch.randn(3, 15), packed, 32)
    with pytest.raises(RuntimeError, match="out_features"):
        linear_packed(torch.randn(3, 16), packed, 50)
    with pytest.raises(RuntimeError, match="bias"):
        linear_packed(torch.randn(3, 16), packed, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="float32"):
        pack_linear_weight(weight.double())

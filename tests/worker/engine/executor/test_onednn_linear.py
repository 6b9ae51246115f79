"""oneDNN's prepacked float32 linear (BERT's GEMMs) against ``F.linear`` and exact GELU."""

import pytest
import torch
from torch.nn import functional as F

from worker.engine.executor.layers.onednn_linear import (
    onednn_linear_available,
    pack_linear_weight,
    packed_linear,
    padded_rows,
)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("gelu", [False, True])
def test_packed_linear_matches_f_linear(rows, gelu):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(160, 96, generator=generator) / 10
    bias = torch.randn(160, generator=generator)
    expected = F.linear(x, weight, bias)
    if gelu:
        expected = F.gelu(expected)  # the exact erf form, BERT's "gelu"
    out = packed_linear(x, pack_linear_weight(weight, 64), bias, gelu=gelu)
    assert out.shape == (rows, 160) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_packed_linear_without_bias():
    x, weight = torch.randn(5, 32), torch.randn(48, 32)
    torch.testing.assert_close(packed_linear(x, pack_linear_weight(weight, 8), None), F.linear(x, weight))


def test_padded_rows_rounds_up_to_the_multiple():
    assert [padded_rows(n) for n in (1, 63, 64, 65, 4096)] == [64, 64, 64, 128, 4096]

"""The C++ varlen bidirectional attention (encoders) against dense SDPA per sequence and its PyTorch twin."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu_attention import varlen_attention_cpu
from kernels.reference import varlen_attention_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _packed(seq_lens, num_heads, head_size, seed=0):
    """q, k, v as strided views of one fused projection [num_tokens, 3, heads, head_size], and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(seq_lens), 3, num_heads, head_size, generator=generator) * 2.0
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (*qkv.unbind(1), cu_seqlens)


def _dense_sdpa(query, key, value, seq_lens, scale):
    """torch's scaled_dot_product_attention, one sequence at a time, without any mask."""
    outs, start = [], 0
    for length in seq_lens:
        q, k, v = (x[start : start + length].transpose(0, 1) for x in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize("head_size", [8, 32, 64, 72])
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [5], [16], [17, 1, 33], [256, 130, 7, 7, 7, 64, 2], [3] * 20],
    ids=["one-token", "short", "one-tile", "odd", "mixed", "equal-run"],
)
def test_matches_dense_sdpa_per_sequence(seq_lens, head_size):
    query, key, value, cu_seqlens = _packed(seq_lens, 3, head_size)
    scale = head_size**-0.5

    out = varlen_attention_cpu(query, key, value, cu_seqlens, scale)

    assert out.shape == query.shape and out.is_contiguous()
    torch.testing.assert_close(out, _dense_sdpa(query, key, value, seq_lens, scale), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        varlen_attention_reference(query, key, value, cu_seqlens, scale), out, atol=1e-5, rtol=1e-4
    )


def test_a_sequence_never_sees_its_neighbours_and_is_batch_invariant():
    seq_lens = [40, 9, 77]
    query, key, value, cu_seqlens = _packed(seq_lens, 4, 32)
    packed = varlen_attention_cpu(query, key, value, cu_seqlens, 0.2)

    alone = varlen_attention_cpu(query[40:49], key[40:49], value[40:49], torch.tensor([0, 9], dtype=torch.int32), 0.2)

    assert torch.equal(packed[40:49], alone)  # same bits, whatever shares the call


def test_thread_count_does_not_change_the_bits():
    query, key, value, cu_seqlens = _packed([100, 31, 31, 5, 200], 6, 32, seed=3)
    one = varlen_attention_cpu(query, key, value, cu_seqlens, 0.1)
    torch.set_num_threads(2)
    try:
        two = varlen_attention_cpu(query, key, value, cu_seqlens, 0.1)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


@pytest.mark.parametrize("length", [17, 33, 40])
def test_scores_far_below_zero_keep_their_softmax(length):
    # Every score is below -10^4 and the keys are padded to whole vectors with zeros: the row max must come
    # from the real keys only, or every exponential would clamp to the same value (a uniform average).
    query = torch.full((length, 1, 32), 1.0)
    key = -(torch.arange(length, dtype=torch.float32) * 0.1 + 10.0).view(length, 1, 1).expand(length, 1, 32)
    value = torch.randn(length, 1, 32, generator=torch.Generator().manual_seed(4))
    cu_seqlens = torch.tensor([0, length], dtype=torch.int32)

    out = varlen_attention_cpu(query, key.contiguous(), value, cu_seqlens, 40.0)

    torch.testing.assert_close(out, _dense_sdpa(query, key, value, [length], 40.0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, value[:1].expand(length, 1, 32), atol=1e-5, rtol=1e-4)


def test_non_positive_scale_raises():
    query, key, value, cu_seqlens = _packed([4], 2, 16)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        varlen_attention_cpu(query, key, value, cu_seqlens, 0.0)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [([0, 5, 5, 10], "strictly increasing"), ([0, 4], "from 0 to num_tokens"), ([1, 10], "from 0 to num_tokens")],
)
def test_bad_cu_seqlens_raise(cu_seqlens, message):
    query, key, value, _ = _packed([10], 2, 16)
    with pytest.raises(RuntimeError, match=message):
        varlen_attention_cpu(query, key, value, torch.tensor(cu_seqlens, dtype=torch.int32), 0.25)


def test_head_size_not_a_multiple_of_8_raises():
    query, key, value, cu_seqlens = _packed([4], 2, 12)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        varlen_attention_cpu(query, key, value, cu_seqlens, 0.25)

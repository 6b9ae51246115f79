"""The C++ causal attention of fresh prompts against causal SDPA per sequence (grouped-query, bfloat16, soft cap)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu_attention import causal_attention_cpu

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _packed(seq_lens, num_heads, num_kv_heads, head_size, dtype=torch.float32, seed=0):
    """q, k, v as strided views of one fused projection [num_tokens, (heads + 2 kv heads) * head_size], and
    cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(seq_lens)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=generator) * 2.0).to(dtype)
    query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    key, value = qkv[:, num_heads * head_size :].view(num_tokens, 2, num_kv_heads, head_size).unbind(1)
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key, value, cu_seqlens


def _causal_sdpa(query, key, value, seq_lens, scale, soft_cap=None):
    """Causal attention one sequence at a time in float32, K/V repeated for the query heads (``repeat_kv``)."""
    group = query.shape[1] // key.shape[1]
    outs, start = [], 0
    for length in seq_lens:
        q, k, v = (x[start : start + length].float().transpose(0, 1) for x in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        if soft_cap is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            scores = torch.tanh(q @ k.transpose(-1, -2) * scale / soft_cap) * soft_cap
            hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
            out = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v
        outs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize("head_size", [8, 64, 72])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [5], [16], [17, 2, 33], [140, 81, 7, 96, 2], [3] * 20],
    ids=["one-token", "short", "one-tile", "odd", "mixed", "equal-run"],
)
def test_float32_matches_causal_sdpa_per_sequence(seq_lens, num_heads, num_kv_heads, head_size):
    query, key, value, cu_seqlens = _packed(seq_lens, num_heads, num_kv_heads, head_size)
    scale = head_size**-0.5

    out = causal_attention_cpu(query, key, value, cu_seqlens, scale)

    assert out.shape == query.shape and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out, _causal_sdpa(query, key, value, seq_lens, scale), atol=1e-5, rtol=1e-4)


def test_bfloat16_is_float32_math_rounded_once():
    seq_lens = [107, 80, 140, 1, 33]
    query, key, value, cu_seqlens = _packed(seq_lens, 9, 3, 64, dtype=torch.bfloat16)

    out = causal_attention_cpu(query, key, value, cu_seqlens, 0.125)

    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    # float32 math on the widened inputs (the scores' channel pairs may sum in another order), rounded once: within
    # half a bfloat16 ulp (2 ** -8 relative) of the float32 kernel's result.
    widened = causal_attention_cpu(query.float(), key.float(), value.float(), cu_seqlens, 0.125)
    torch.testing.assert_close(out.float(), widened, atol=1e-5, rtol=2**-8 + 1e-5)
    torch.testing.assert_close(out.float(), _causal_sdpa(query, key, value, seq_lens, 0.125), atol=1e-2, rtol=1e-2)


def test_soft_cap_matches_capped_scores():
    seq_lens = [30, 1, 65]
    query, key, value, cu_seqlens = _packed(seq_lens, 4, 2, 32)

    out = causal_attention_cpu(query, key, value, cu_seqlens, 0.5, logits_soft_cap=3.0)

    expected = _causal_sdpa(query, key, value, seq_lens, 0.5, soft_cap=3.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(out, _causal_sdpa(query, key, value, seq_lens, 0.5), atol=1e-3)


def test_a_sequence_never_sees_its_neighbours_and_is_batch_invariant_and_thread_invariant():
    seq_lens = [40, 9, 77]
    query, key, value, cu_seqlens = _packed(seq_lens, 6, 2, 32)
    packed = causal_attention_cpu(query, key, value, cu_seqlens, 0.2)

    alone = causal_attention_cpu(query[40:49], key[40:49], value[40:49], torch.tensor([0, 9], dtype=torch.int32), 0.2)
    torch.set_num_threads(2)
    two_threads = causal_attention_cpu(query, key, value, cu_seqlens, 0.2)

    assert torch.equal(packed[40:49], alone)  # same bits, whatever shares the call
    assert torch.equal(packed, two_threads)


def test_writes_into_out():
    query, key, value, cu_seqlens = _packed([12, 20], 4, 2, 16)
    out = torch.full((40, 4, 16), float("nan"))

    returned = causal_attention_cpu(query, key, value, cu_seqlens, 0.25, out=out[4:36])

    assert returned.data_ptr() == out[4:36].data_ptr()
    assert torch.isnan(out[:4]).all() and torch.isnan(out[36:]).all()
    torch.testing.assert_close(out[4:36], _causal_sdpa(query, key, value, [12, 20], 0.25), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda q, k, v, cu: (q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu),
            "multiple of num_kv_heads",
        ),
        (lambda q, k, v, cu: (q, k.to(torch.bfloat16), v, cu), "one dtype"),
        (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 5, 5, 32], dtype=torch.int32)), "strictly increasing"),
        (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 30], dtype=torch.int32)), "from 0 to num_tokens"),
        (lambda q, k, v, cu: (q, k[:30], v[:30], cu), "num_tokens"),
    ],
    ids=["heads", "dtype", "empty-sequence", "cu-seqlens-end", "key-tokens"],
)
def test_rejects_bad_arguments(change, message):
    query, key, value, cu_seqlens = _packed([12, 20], 4, 2, 16)

    with pytest.raises(RuntimeError, match=message):
        causal_attention_cpu(*change(query, key, value, cu_seqlens), 0.25)

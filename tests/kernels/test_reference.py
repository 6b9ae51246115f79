"""The plain attention twins against dense attention, and the vectorised engine path against the twins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import (
    dequantize_kv,
    dequantize_kv_int4,
    paged_attention_reference,
    quantize_kv,
    quantize_kv_int4,
    reshape_and_cache,
)
from worker.engine.executor.layers.attention import build_attention_metadata, paged_attention_forward, write_to_kv_cache

NUM_BLOCKS = 128
HEAD_SIZE = 8

# (query_len, seq_len) per sequence, in batch order.
DECODE = [(1, 5), (1, 17), (1, 1), (1, 33), (1, 16)]
PREFILL = [(7, 7), (13, 13), (3, 3), (1, 1), (16, 16)]
MIXED = [(1, 9), (5, 12), (1, 20), (16, 16), (4, 30), (1, 2), (2, 2)]  # prefix-cached chunks among decodes
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}


def _setup(batch, num_heads, num_kv_heads, block_size, dtype=torch.float32, seed=0):
    """Random paged cache holding each sequence's context prefix, random new Q/K/V, shuffled block tables.

    Unused slots hold large finite garbage, so any leak through the masks shows up in the outputs.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_cache = (torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE, generator=gen) * 100).to(dtype)
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    block_tables = []
    for _, seq_len in batch:
        num_blocks = -(-seq_len // block_size)
        block_tables.append(block_ids[:num_blocks])
        del block_ids[:num_blocks]
    metadata = build_attention_metadata(
        [q for q, _ in batch],
        [s for _, s in batch],
        block_tables,
        block_size,
        num_queries_per_kv=num_heads // num_kv_heads,
        dtype=dtype,
    )
    # Context already cached (positions before this step's queries).
    prefix_slots = [
        table[pos // block_size] * block_size + pos % block_size
        for (query_len, seq_len), table in zip(batch, block_tables)
        for pos in range(seq_len - query_len)
    ]
    if prefix_slots:
        n = len(prefix_slots)
        reshape_and_cache(
            torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype),
            torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype),
            kv_cache,
            torch.tensor(prefix_slots),
        )
    num_tokens = sum(q for q, _ in batch)
    query = torch.randn(num_tokens, num_heads, HEAD_SIZE, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, HEAD_SIZE, generator=gen).to(dtype)
    return kv_cache, metadata, query, key, value


def _reference(kv_cache, metadata, query, key, value):
    kv_cache = kv_cache.clone()
    reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
    out = paged_attention_reference(
        query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, HEAD_SIZE**-0.5
    )
    return out, kv_cache


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_fast_path_matches_reference(kind, num_heads, num_kv_heads, block_size):
    kv_cache, metadata, query, key, value = _setup(BATCHES[kind], num_heads, num_kv_heads, block_size)
    expected, expected_cache = _reference(kv_cache, metadata, query, key, value)

    out = paged_attention_forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_cache, expected_cache)


def test_plan_is_reused_across_layers():
    """A second layer over the same metadata (another cache) gives its own correct result."""
    batch = MIXED
    caches = [_setup(batch, 4, 2, 4, seed=seed) for seed in (1, 2)]
    metadata = caches[0][1]
    for kv_cache, _, query, key, value in caches:
        expected, _ = _reference(kv_cache, metadata, query, key, value)
        out = paged_attention_forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)
        # The second cache's context sits in other blocks, so this plan reads its garbage (V about 100): float32
        # rounding of such values is about 1e-4, whatever the summation order.
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-5)


def test_fast_path_bfloat16_close_to_float32_reference():
    kv_cache, metadata, query, key, value = _setup(MIXED, 4, 2, 4, dtype=torch.bfloat16)
    expected, _ = _reference(kv_cache.float(), metadata, query.float(), key.float(), value.float())

    out = paged_attention_forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)

    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_reference_matches_dense_causal_attention(num_heads, num_kv_heads):
    """One sequence, prefill of 6 new tokens over 5 cached ones: same as dense causal SDPA over all 11."""
    block_size, seq_len, query_len = 4, 11, 6
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(seq_len, num_kv_heads, HEAD_SIZE, generator=gen)
    values = torch.randn(seq_len, num_kv_heads, HEAD_SIZE, generator=gen)
    queries = torch.randn(seq_len, num_heads, HEAD_SIZE, generator=gen)
    block_table = [7, 2, 5]
    slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
    kv_cache = torch.zeros(2, 8, block_size, num_kv_heads, HEAD_SIZE)
    reshape_and_cache(keys, values, kv_cache, slots)

    out = paged_attention_reference(
        queries[-query_len:],
        kv_cache,
        torch.tensor([0, query_len]),
        torch.tensor([seq_len]),
        torch.tensor([block_table]),
        HEAD_SIZE**-0.5,
    )

    rep = num_heads // num_kv_heads
    dense = F.scaled_dot_product_attention(
        queries.transpose(0, 1),
        keys.repeat_interleave(rep, dim=1).transpose(0, 1),
        values.repeat_interleave(rep, dim=1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, dense[-query_len:], atol=1e-5, rtol=1e-5)


def test_cache_writes_agree():
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(2, 5, 2, HEAD_SIZE, generator=gen)
    slots = torch.tensor([13, 0, 7, 31, 8])
    expected = torch.zeros(2, 8, 4, 2, HEAD_SIZE)
    reshape_and_cache(key, value, expected, slots)
    cache = torch.zeros_like(expected)

    write_to_kv_cache(key, value, cache, slots)

    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, 3, 1], key[0])  # slot 13 = block 3, offset 1
    assert torch.equal(cache[1, 7, 3], value[3])  # slot 31 = block 7, offset 3


def test_build_attention_metadata_slots_and_shapes():
    metadata = build_attention_metadata([2, 1], [6, 3], [[5, 2], [9]], block_size=4, num_queries_per_kv=1)

    assert metadata.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 9 * 4 + 2]
    assert metadata.query_start_loc.tolist() == [0, 2, 3]
    assert metadata.seq_lens.tolist() == [6, 3]
    assert metadata.block_tables.tolist() == [[5, 2], [9, 0]]
    assert metadata.num_seqs == 2 and metadata.num_tokens == 3 and metadata.num_decode_tokens == 1


@pytest.mark.parametrize(
    "query_lens,seq_lens,block_tables,message",
    [
        ([1], [1, 2], [[0]], "one entry per sequence"),
        ([3], [2], [[0]], "query_len"),
        ([1], [9], [[0, 1]], "cannot hold"),
    ],
)
def test_build_attention_metadata_rejects_bad_input(query_lens, seq_lens, block_tables, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, seq_lens, block_tables, block_size=4, num_queries_per_kv=1)


def test_int4_rows_round_trip_within_half_a_step_per_group():
    """Two codes a byte (element 2i low), a scale and zero per group of 32 channels; every element comes back
    within half its group's step; a constant group comes back exactly; a 16-channel head is one group."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 64, generator=gen) * torch.linspace(0.1, 10, 64)
    x[1, 0, 32:] = 2.5
    data, params = quantize_kv_int4(x)
    assert data.dtype == torch.uint8 and data.shape == (3, 2, 32) and params.shape == (3, 2, 4)
    back = dequantize_kv_int4(data, params)
    step = params[..., 0::2].repeat_interleave(32, dim=-1)
    assert bool(((back - x).abs() <= step / 2 + 1e-5).all())
    assert torch.equal(back[1, 0, 32:], x[1, 0, 32:])
    codes = torch.floor((x[0, 0, :2] - params[0, 0, 1]) / params[0, 0, 0] + 0.5)
    assert data[0, 0, 0].item() == int(codes[0]) | int(codes[1]) << 4
    assert quantize_kv_int4(x[..., :16])[1].shape == (3, 2, 2)
    with pytest.raises(ValueError, match="divisible"):
        quantize_kv_int4(x[..., :48])


def test_int8_rows_take_one_scale_per_group_of_32_channels():
    """Scales ``[..., head_size // 32]``, each the absmax of its own 32 channels over 127 (an all-zero group
    gets 1 and comes back as zeros); a group 100x its neighbour leaves the neighbour's precision alone; rows
    come back within half a step of their group; a 16-channel head is one group; 48 channels refused."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 64, generator=gen)
    x[0, 1, 32:] *= 100
    x[2, 0, :32] = 0.0
    data, scales = quantize_kv(x, "int8")
    assert data.shape == x.shape and scales.shape == (3, 2, 2)
    torch.testing.assert_close(scales[0, 0], x[0, 0].view(2, 32).abs().amax(-1) / 127, rtol=0, atol=0)
    assert scales[2, 0, 0].item() == 1.0
    back = dequantize_kv(data, scales)
    assert torch.equal(back[2, 0, :32], torch.zeros(32))
    # The 100x group does not coarsen its neighbour, which one scale over the whole head would (half its step).
    assert (back[0, 1, :32] - x[0, 1, :32]).abs().max() < scales[0, 1, 1] / 10
    step = scales.repeat_interleave(32, dim=-1)
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert quantize_kv(x[..., :16], "int8")[1].shape == (3, 2, 1)
    with pytest.raises(ValueError, match="divisible"):
        quantize_kv(x[..., :48], "int8")


def test_fp8_rows_take_one_scale_a_head():
    """float8 e4m3: one scale per (token, head), its absmax over 448; e4m3's 3 mantissa bits keep every element
    within 1/16 of itself (a normal number) however large its neighbours."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 64, generator=gen)
    x[0, 1, 32:] *= 100
    data, scales = quantize_kv(x, "fp8_e4m3")
    assert data.dtype == torch.float8_e4m3fn and scales.shape == (3, 2, 1)
    torch.testing.assert_close(scales[..., 0], x.abs().amax(-1) / 448, rtol=0, atol=0)
    back = dequantize_kv(data, scales)
    assert bool(((back - x).abs() <= x.abs() / 16 + scales * 2**-9).all())  # + half e4m3's smallest subnormal

"""Cascade (shared-prefix) attention against the plain paged-attention reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.cpu_extension import DISABLE_ENV
from kernels.reference import paged_attention_reference
from worker.engine.executor.layers.attention import build_attention_metadata, paged_attention_forward
from worker.engine.executor.layers.attention import cascade as cascade_attention
from worker.engine.executor.layers.attention.cascade import (
    merge_attention_states,
    num_shared_prefix_blocks,
    shared_prefix_groups,
)

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def test_shared_blocks_stop_at_the_first_difference_and_at_the_least_computed_sequence():
    tables = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3]])

    assert num_shared_prefix_blocks(tables, [40, 40, 40], BLOCK_SIZE) == 3
    assert num_shared_prefix_blocks(tables, [40, 17, 40], BLOCK_SIZE) == 2  # 17 tokens: 2 full blocks computed
    assert num_shared_prefix_blocks(tables, [40, 7, 40], BLOCK_SIZE) == 0
    assert num_shared_prefix_blocks(tables[:1], [40], BLOCK_SIZE) == 0  # one sequence shares with nobody
    assert num_shared_prefix_blocks(torch.tensor([[1, 2], [3, 2]]), [16, 16], BLOCK_SIZE) == 0
    assert num_shared_prefix_blocks(tables[[0, 2]], [40, 40], BLOCK_SIZE) == 4


def test_groups_are_sequences_behind_the_same_first_block_with_enough_shared_tokens(monkeypatch):
    monkeypatch.setattr(cascade_attention, "MIN_SEQS", 2)
    monkeypatch.setattr(cascade_attention, "MIN_SHARED_TOKENS", 2 * BLOCK_SIZE)
    tables = torch.tensor(
        [[5, 6, 7, 1], [9, 8, 2, 0], [5, 6, 7, 3], [9, 8, 4, 0], [11, 12, 13, 14], [5, 6, 15, 0], [9, 16, 0, 0]]
    )
    computed = [32, 24, 32, 24, 32, 24, 24]

    groups = shared_prefix_groups(tables, computed, BLOCK_SIZE)

    # 5,6 shared by sequences 0, 2, 5 (sequence 5 diverges after two blocks); 9 alone is too short for 1, 3, 6.
    assert groups == [([0, 2, 5], 2)]
    assert shared_prefix_groups(tables, [32, 24, 32, 24, 32, 8, 24], BLOCK_SIZE) == [([0, 2], 3)]


def test_merging_two_partial_attentions_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    full = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v

    parts = []
    for keys in (slice(0, 2), slice(2, 5)):
        scores = q @ k[..., keys, :].transpose(-1, -2) * 0.25
        parts += [torch.softmax(scores, -1) @ v[..., keys, :], torch.logsumexp(scores, -1)]
    out_a, lse_a, out_b, lse_b = (t[0].transpose(0, 1) for t in parts)

    merged = merge_attention_states(out_a, lse_a, out_b, lse_b)

    torch.testing.assert_close(merged, full[0].transpose(0, 1), atol=1e-6, rtol=1e-5)


def _shared_prefix_batch(query_lens, own_lens, shared_blocks, seed=0):
    """Sequences sharing ``shared_blocks`` physical blocks, then own blocks; cache full of random K/V."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, 400, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    free = torch.randperm(400, generator=gen).tolist()
    shared = free[:shared_blocks]
    del free[:shared_blocks]
    seq_lens = [shared_blocks * BLOCK_SIZE + own for own in own_lens]
    tables = []
    for seq_len in seq_lens:
        own_blocks = -(-seq_len // BLOCK_SIZE) - shared_blocks
        tables.append(shared + free[:own_blocks])
        del free[:own_blocks]
    metadata = build_attention_metadata(
        query_lens, seq_lens, tables, BLOCK_SIZE, num_queries_per_kv=NUM_HEADS // NUM_KV_HEADS
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    return query, key, value, kv_cache, metadata


@pytest.mark.parametrize(
    "query_lens,own_lens",
    [
        ([1] * 10, [3, 9, 1, 17, 8, 30, 2, 5, 11, 4]),  # decode rows only
        ([1, 7, 1, 1, 12, 1, 3, 1, 1, 20], [3, 9, 1, 17, 12, 30, 3, 5, 11, 20]),  # prefills over the prefix too
    ],
)
@pytest.mark.parametrize("logits_soft_cap", [None, 1.5])
def test_cascade_path_matches_reference_when_many_sequences_share_a_long_prefix(query_lens, own_lens, logits_soft_cap):
    """Also with Gemma 2's soft-cap, applied to the prefix's and the suffix's scores before the merge."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the cascade path needs the CPU kernels")
    shared_blocks = cascade_attention.MIN_SHARED_TOKENS // BLOCK_SIZE + 2
    query, key, value, kv_cache, metadata = _shared_prefix_batch(query_lens, own_lens, shared_blocks)
    expected_cache = kv_cache.clone()

    out = paged_attention_forward(
        query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5, logits_soft_cap=logits_soft_cap
    )

    [group] = metadata.plan.cascade.groups
    assert group.prefix_block_ids.numel() == shared_blocks and group.token_idx is None
    flat = expected_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    flat[0][metadata.slot_mapping], flat[1][metadata.slot_mapping] = key, value
    expected = paged_attention_reference(
        query,
        expected_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        HEAD_SIZE**-0.5,
        logits_soft_cap=logits_soft_cap,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_two_preambles_and_unrelated_sequences_get_one_cascade_per_preamble():
    """Lines behind two different preambles plus a few unrelated ones in one step: each preamble's group
    attends its prefix once, the unrelated sequences their whole context; all rows match the reference."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the cascade path needs the CPU kernels")
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(2, 600, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    free = torch.randperm(600, generator=gen).tolist()
    shared_blocks = cascade_attention.MIN_SHARED_TOKENS // BLOCK_SIZE + 1
    preambles = [free[:shared_blocks], free[shared_blocks : 2 * shared_blocks]]
    del free[: 2 * shared_blocks]
    layout = [(0, 1, 9), (1, 1, 4), (0, 3, 12), (None, 1, 40), (1, 1, 17)] * 4 + [(0, 1, 3), (None, 5, 9)]
    query_lens, seq_lens, tables = [], [], []
    for preamble, query_len, own in layout:
        prefix = [] if preamble is None else preambles[preamble]
        seq_len = len(prefix) * BLOCK_SIZE + own
        own_blocks = -(-seq_len // BLOCK_SIZE) - len(prefix)
        tables.append(prefix + free[:own_blocks])
        del free[:own_blocks]
        query_lens.append(query_len)
        seq_lens.append(seq_len)
    metadata = build_attention_metadata(
        query_lens, seq_lens, tables, BLOCK_SIZE, num_queries_per_kv=NUM_HEADS // NUM_KV_HEADS
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    expected_cache = kv_cache.clone()

    out = paged_attention_forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)

    groups = metadata.plan.cascade.groups
    assert [g.prefix_block_ids.tolist() for g in groups] == preambles
    flat = expected_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    flat[0][metadata.slot_mapping], flat[1][metadata.slot_mapping] = key, value
    expected = paged_attention_reference(
        query, expected_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, HEAD_SIZE**-0.5
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_seqs,shared_tokens", [(cascade_attention.MIN_SEQS - 1, 400), (10, 200)])
def test_cascade_is_not_used_below_its_thresholds(num_seqs, shared_tokens):
    query, key, value, kv_cache, metadata = _shared_prefix_batch(
        [1] * num_seqs, [5] * num_seqs, shared_tokens // BLOCK_SIZE
    )

    paged_attention_forward(query, key, value, kv_cache, metadata, 0.125)

    assert metadata.plan.cascade is None

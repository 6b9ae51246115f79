"""Draft trees through every CPU attention path of a step (the C++ kernel, the masked groups without the kernels,
cascade attention over a shared prefix), against the PyTorch twin with the tree mask, and the metadata's
depth-based positions (docs/engine.md, "Speculative decoding")."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.cpu_extension import DISABLE_ENV
from kernels.reference import paged_attention_reference
from worker.engine.executor.layers.attention import build_attention_metadata, paged_attention_forward
from worker.engine.executor.layers.attention import cascade as cascade_attention

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
TREE = [-1, -1, 0, 1, 2, 2]  # two branches; node 4 and 5 are siblings at depth 3


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def _batch(num_seqs: int, shared_blocks: int, use_cpu_kernels: bool, seed: int = 0):
    """``num_seqs`` sequences behind ``shared_blocks`` shared blocks: every other one verifies ``TREE``, the rest
    alternate decode rows and a chain of 3 drafts."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, 300, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    free = torch.randperm(300, generator=gen).tolist()
    shared = free[:shared_blocks]
    del free[:shared_blocks]
    query_lens, seq_lens, tables, parents = [], [], [], []
    for i in range(num_seqs):
        tree = TREE if i % 2 == 0 else None
        query_len = 1 + len(TREE) if tree else (1 if i % 4 == 1 else 4)
        seq_len = shared_blocks * BLOCK_SIZE + 5 + 3 * i + query_len
        own_blocks = -(-seq_len // BLOCK_SIZE) - shared_blocks
        tables.append(shared + free[:own_blocks])
        del free[:own_blocks]
        query_lens.append(query_len)
        seq_lens.append(seq_len)
        parents.append(tree)
    metadata = build_attention_metadata(
        query_lens,
        seq_lens,
        tables,
        BLOCK_SIZE,
        num_queries_per_kv=NUM_HEADS // NUM_KV_HEADS,
        use_cpu_kernels=use_cpu_kernels,
        tree_parents=parents,
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    return query, key, value, kv_cache, metadata


@pytest.mark.parametrize(
    ("path", "num_seqs", "shared_blocks", "use_cpu_kernels"),
    [
        ("kernel", 4, 1, True),
        ("groups", 4, 1, False),
        ("cascade", cascade_attention.MIN_SEQS, cascade_attention.MIN_SHARED_TOKENS // BLOCK_SIZE + 1, True),
    ],
)
def test_every_path_applies_the_tree_mask(path, num_seqs, shared_blocks, use_cpu_kernels):
    if use_cpu_kernels and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH")
    query, key, value, kv_cache, metadata = _batch(num_seqs, shared_blocks, use_cpu_kernels)
    assert (metadata.plan.cascade is not None) == (path == "cascade")
    assert (metadata.plan.kernel is not None) == (path == "kernel")
    expected_cache = kv_cache.clone()
    out = paged_attention_forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)
    flat = expected_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    flat[0][metadata.slot_mapping], flat[1][metadata.slot_mapping] = key, value
    args = (query, expected_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, HEAD_SIZE**-0.5)
    expected = paged_attention_reference(*args, tree_mask=metadata.tree_mask)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(out, paged_attention_reference(*args), atol=1e-3)  # the mask mattered


def test_tree_positions_follow_depth_and_slots_stay_consecutive():
    _, _, _, _, metadata = _batch(2, 1, use_cpu_kernels=False)
    last = metadata.seq_lens_list[0] - len(TREE) - 1
    tree_rows = slice(0, 1 + len(TREE))
    assert metadata.positions[tree_rows].tolist() == [last + d for d in (0, 1, 1, 2, 2, 3, 3)]
    slots = metadata.slot_mapping[tree_rows].tolist()
    assert len(set(slots)) == len(slots)
    chain_rows = slice(1 + len(TREE), None)
    assert metadata.tree_mask is not None and metadata.tree_mask[chain_rows].eq(0).all()
    with pytest.raises(ValueError, match="tree"):
        build_attention_metadata([3], [10], [[0, 1]], BLOCK_SIZE, num_queries_per_kv=1, tree_parents=[TREE])
    with pytest.raises(ValueError, match="sliding"):
        build_attention_metadata(
            [7], [10], [[0, 1]], BLOCK_SIZE, num_queries_per_kv=1, tree_parents=[TREE], sliding_window=4
        )

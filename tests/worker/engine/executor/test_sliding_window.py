"""Sliding-window attention and soft-capping through the engine's attention layer, on every CPU path, against
the reference twin (``kernels/reference.py``).

Blocks wholly before a sequence's first window point at a null block, as the KV cache manager leaves them
(docs/engine.md, "Sliding-window attention"): a path that read them would attend zeros.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.cpu_extension import DISABLE_ENV
from kernels.reference import paged_attention_reference, reshape_and_cache
from worker.engine.executor.layers.attention import build_attention_metadata, paged_attention_forward
from worker.engine.executor.layers.attention import plan as attention_plan

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 16
WINDOW = 6
NULL_BLOCK = 0
# (query_len, seq_len): decodes past the window, a fresh prompt longer and one shorter than the window, a chunk
# after a cached context, a decode within the window.
BATCH = [(1, 17), (9, 9), (4, 4), (5, 14), (1, 5), (1, 26)]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen) * 3
    kv_cache[:, NULL_BLOCK] = 0
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    tables = []
    for query_len, seq_len in BATCH:
        first_visible = max(0, seq_len - query_len - WINDOW + 1)
        num_blocks_needed = -(-seq_len // BLOCK_SIZE)
        num_skipped = first_visible // BLOCK_SIZE
        tables.append([NULL_BLOCK] * num_skipped + [free.pop() for _ in range(num_blocks_needed - num_skipped)])
    num_tokens = sum(q for q, _ in BATCH)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=gen)
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    return query, key, value, kv_cache, tables


@pytest.mark.parametrize("logits_soft_cap", [None, 1.5])
@pytest.mark.parametrize(
    ("use_cpu_kernels", "short_extends_to_kernel"),
    [(True, True), (True, False), (False, False)],
    ids=["kernels-short-extends", "kernels-decode-only", "pytorch"],
)
def test_windowed_layer_matches_reference_on_every_path(
    use_cpu_kernels, short_extends_to_kernel, logits_soft_cap, monkeypatch
):
    if use_cpu_kernels and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH")
    if not short_extends_to_kernel:  # every extend of the batch is short: keep them off the kernel to test the rest
        monkeypatch.setattr(attention_plan, "MAX_KERNEL_QUERY_LEN", 1)
    query, key, value, kv_cache, tables = _batch()
    metadata = build_attention_metadata(
        [q for q, _ in BATCH],
        [s for _, s in BATCH],
        tables,
        BLOCK_SIZE,
        num_queries_per_kv=NUM_HEADS // NUM_KV_HEADS,
        use_cpu_kernels=use_cpu_kernels,
        sliding_window=WINDOW,
    )
    plan = metadata.sliding_plan
    assert plan is not None and plan is not metadata.plan and plan.sliding_window == WINDOW
    assert plan.cascade is None
    # The 9-token fresh prompt is longer than the window: kernel or masked group; the 4-token one stays fresh (the
    # causal kernel with the kernels, a causal SDPA without).
    assert plan.fresh_prefills == [(10, 14)] and metadata.plan.fresh_prefills == [(1, 10), (10, 14)]
    assert [(run.start, run.end) for run in plan.fresh_runs] == ([(10, 14)] if use_cpu_kernels else [])
    if use_cpu_kernels and short_extends_to_kernel:  # every other query is at most 9 tokens: the kernel takes them
        assert not plan.groups and plan.kernel is not None and plan.kernel.token_idx is not None
    else:
        assert (plan.kernel is not None) == use_cpu_kernels
    expected_cache = kv_cache.clone()
    reshape_and_cache(key, value, expected_cache, metadata.slot_mapping)
    scale = HEAD_SIZE**-0.5

    out = paged_attention_forward(
        query, key, value, kv_cache, metadata, scale, sliding_window=WINDOW, logits_soft_cap=logits_soft_cap
    )
    global_out = paged_attention_forward(query, key, value, kv_cache.clone(), metadata, scale)

    assert torch.equal(kv_cache, expected_cache)
    args = (metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale)
    expected = paged_attention_reference(
        query, expected_cache, *args, sliding_window=WINDOW, logits_soft_cap=logits_soft_cap
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # The global layer of the same step (full context, no cap) differs: the window is really applied.
    torch.testing.assert_close(
        global_out, paged_attention_reference(query, expected_cache, *args), atol=2e-5, rtol=1e-5
    )
    assert not torch.allclose(out, global_out, atol=1e-3)


def test_layer_window_must_be_the_metadata_window():
    query, key, value, kv_cache, tables = _batch()
    metadata = build_attention_metadata(
        [q for q, _ in BATCH], [s for _, s in BATCH], tables, BLOCK_SIZE, num_queries_per_kv=3, sliding_window=8
    )

    with pytest.raises(AssertionError, match="another sliding window"):
        paged_attention_forward(query, key, value, kv_cache, metadata, 0.25, sliding_window=WINDOW)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        build_attention_metadata([1], [3], [[1]], BLOCK_SIZE, num_queries_per_kv=3, sliding_window=0)

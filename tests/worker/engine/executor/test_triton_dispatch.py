"""The attention path's dispatch to the Triton kernels (CUDA), checked on CPU through Triton's interpreter
(natively where CUDA is available).

CPU engines never take the Triton path (:func:`triton_kernels_apply` is False there); here it is forced with
``use_triton_kernels=True`` and compared with the PyTorch path on the same batch.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.7.1, the `test` extra)")

from kernels.reference import reshape_and_cache
from worker.engine.executor.layers.attention import (
    build_attention_metadata,
    paged_attention_forward,
    triton_kernels_apply,
)
from worker.engine.executor.model_runner import copy_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 16
# (query_len, seq_len): decode, fresh prompt, prefix-cached chunk, extend after a cached context.
MIXED = [(1, 9), (5, 5), (4, 21), (1, 2), (3, 12)]


def test_triton_applies_on_cuda_only() -> None:
    assert not triton_kernels_apply("cpu")
    assert triton_kernels_apply("cuda") == (importlib.util.find_spec("triton") is not None)
    metadata = build_attention_metadata([1], [3], [[0]], BLOCK_SIZE, num_queries_per_kv=1)
    assert metadata.plan.triton is None


def _batch(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 16
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = []
    prefix_slots = []
    for query_len, seq_len in MIXED:
        table = [block_ids.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables.append(table)
        prefix_slots += [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(seq_len - query_len)]
    n = len(prefix_slots)
    reshape_and_cache(
        torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype),
        torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype),
        kv_cache,
        torch.tensor(prefix_slots),
    )
    num_tokens = sum(q for q, _ in MIXED)
    query, key, value = (
        torch.randn(num_tokens, heads, HEAD_SIZE, generator=gen).to(dtype)
        for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    return query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kv_cache.to(DEVICE), block_tables


@pytest.mark.parametrize(
    ("sliding_window", "logits_soft_cap"), [(None, None), (7, None), (7, 1.5)], ids=["global", "window", "window-cap"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_through_triton_matches_the_cpu_path(
    dtype: torch.dtype, sliding_window: int | None, logits_soft_cap: float | None
) -> None:
    """Also a sliding-window layer (contexts up to 21 tokens, window 7) and Gemma 2's soft-cap."""
    torch.set_num_threads(1)
    query, key, value, kv_cache, block_tables = _batch(dtype)
    kwargs = {"num_queries_per_kv": NUM_HEADS // NUM_KV_HEADS, "dtype": dtype, "device": DEVICE}
    query_lens, seq_lens = [q for q, _ in MIXED], [s for _, s in MIXED]
    kwargs["sliding_window"] = sliding_window
    cpu_metadata = build_attention_metadata(
        query_lens, seq_lens, block_tables, BLOCK_SIZE, use_triton_kernels=False, **kwargs
    )
    triton_metadata = build_attention_metadata(
        query_lens, seq_lens, block_tables, BLOCK_SIZE, use_triton_kernels=True, **kwargs
    )
    assert triton_metadata.plan.triton is not None and triton_metadata.plan.triton.max_query_len == 5
    if sliding_window is not None:
        assert triton_metadata.sliding_plan is not None
        assert triton_metadata.sliding_plan.triton is not None
        assert triton_metadata.sliding_plan.sliding_window == sliding_window
    cpu_cache, triton_cache = kv_cache.clone(), kv_cache.clone()
    layer = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}

    expected = paged_attention_forward(query, key, value, cpu_cache, cpu_metadata, HEAD_SIZE**-0.5, **layer)
    out = paged_attention_forward(query, key, value, triton_cache, triton_metadata, HEAD_SIZE**-0.5, **layer)

    assert torch.equal(triton_cache, cpu_cache)  # this step's K/V stored at the same slots
    tolerance = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "blocks_to_copy",
    [[(1, 4), (1, 5), (2, 0)], [(0, 1), (1, 2)]],  # the second chains: it takes the gather-then-scatter path
)
def test_copy_blocks_through_triton_matches_torch(blocks_to_copy: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, 6, 4, 1, 8, generator=gen).to(DEVICE) for _ in range(2)]
    originals = [cache.clone() for cache in caches]
    copy_blocks(caches, blocks_to_copy, use_triton_kernels=True)
    for cache, original in zip(caches, originals):
        for src, dst in blocks_to_copy:
            assert torch.equal(cache[:, dst], original[:, src])  # read before the call, even along a chain
        untouched = [i for i in range(6) if i not in {dst for _, dst in blocks_to_copy}]
        assert torch.equal(cache[:, untouched], original[:, untouched])

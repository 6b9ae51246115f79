"""The token-tree mask of speculative verification in every paged-attention kernel: the C++ CPU kernel, the Triton
kernel (Triton's interpreter without CUDA, tiny shapes) and their PyTorch twin, each against dense
``scaled_dot_product_attention`` with the tree mask built from the parents directly (Miao et al. 2023, "SpecInfer")."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from kernels import reference
from kernels.cpu_attention import paged_attention_cpu
from worker.engine.executor.layers.attention.tree import tree_mask_bits

# Per sequence: (cached tokens before the query, the tree's parent_idx or None). A tree sequence's query is its
# last token then the nodes; None is an ordinary causal query of the given length (a decode or a chain).
TREE_BATCH = [
    (5, [-1, -1, 0, 1, 2, 2, -1, 6]),  # three branches, one of depth 4
    (0, None),  # placeholder replaced below by a causal chunk
    (13, [-1, 0, 1, 2, 3]),  # a chain written as a tree: the mask is the causal one
    (9, [-1, -1, -1, -1]),  # four siblings
    (2, [-1]),
]
CAUSAL = {1: (11, 4)}  # sequence 1: 11 cached tokens, then a causal query of 4 (a verified chain)


def _batch(block_size: int, num_kv_heads: int, num_queries_per_kv: int, head_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query_lens, seq_lens, bits, parents_of = [], [], [], []
    for i, (num_cached, parents) in enumerate(TREE_BATCH):
        if i in CAUSAL:
            num_cached, query_len = CAUSAL[i]
            bits.extend([0] * query_len)
        else:
            assert parents is not None
            query_len = 1 + len(parents)
            bits.extend(tree_mask_bits(parents))
        query_lens.append(query_len)
        seq_lens.append(num_cached + query_len)
        parents_of.append(parents if i not in CAUSAL else None)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    for s, (count, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        tables[s, :count] = torch.tensor(block_ids[:count])
        del block_ids[:count]
        positions = torch.arange(seq_len)
        slots = tables[s].long()[positions // block_size] * block_size + positions % block_size
        key = torch.randn(seq_len, num_kv_heads, head_size, generator=generator)
        reference.reshape_and_cache(key, torch.randn(key.shape, generator=generator), kv_cache, slots)
    query = torch.randn(sum(query_lens), num_kv_heads * num_queries_per_kv, head_size, generator=generator) * 2
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, kv_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), tables)
    return args, torch.tensor(bits, dtype=torch.int64), parents_of


def _dense_tree_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, parents_of):
    """Each sequence's context gathered into dense K/V and one SDPA with the mask built by walking the parents:
    a node sees the cached context, the last token (query row 0), its ancestors and itself."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_queries_per_kv = query.shape[1] // num_kv_heads
    output = torch.empty(query.shape)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        query_len = end - start
        num_cached = seq_len - query_len
        positions = torch.arange(seq_len)
        blocks = block_tables[s].long()[positions // block_size]
        keys = kv_cache[0][blocks, positions % block_size].repeat_interleave(num_queries_per_kv, dim=1)
        values = kv_cache[1][blocks, positions % block_size].repeat_interleave(num_queries_per_kv, dim=1)
        mask = torch.zeros(query_len, seq_len, dtype=torch.bool)
        mask[:, :num_cached] = True
        for row in range(query_len):
            if parents_of[s] is None:
                mask[row, num_cached : num_cached + row + 1] = True
                continue
            node = row
            while True:
                mask[row, num_cached + node] = True
                if node == 0:
                    break
                node = parents_of[s][node - 1] + 1  # parent -1 is the last token, query row 0
        q, k, v = query[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        output[start:end] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return output


def test_tree_mask_bits():
    assert tree_mask_bits([-1, -1, 0, 2]) == [0b1, 0b11, 0b101, 0b1011, 0b11011]
    assert tree_mask_bits([-1, 0]) == [0b1, 0b11, 0b111]  # a chain is causal


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_kv_heads", "num_queries_per_kv"), [(2, 1), (1, 3)])
def test_reference_equals_dense_tree_attention(block_size, num_kv_heads, num_queries_per_kv):
    args, bits, parents_of = _batch(block_size, num_kv_heads, num_queries_per_kv, head_size=16)
    scale = 16**-0.5
    dense = _dense_tree_attention(*args, scale, parents_of)
    twin = reference.paged_attention_reference(*args, scale, tree_mask=bits)
    torch.testing.assert_close(twin, dense, atol=2e-5, rtol=1e-5)
    # The mask matters: without it the tree rows differ.
    assert not torch.allclose(reference.paged_attention_reference(*args, scale), dense, atol=1e-3)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_kv_heads", "num_queries_per_kv", "head_size"), [(2, 1, 64), (1, 3, 24), (2, 2, 128)])
def test_cpu_kernel_equals_dense_tree_attention(block_size, num_kv_heads, num_queries_per_kv, head_size, soft_cap):
    args, bits, parents_of = _batch(block_size, num_kv_heads, num_queries_per_kv, head_size)
    scale = head_size**-0.5
    out = paged_attention_cpu(*args, scale, logits_soft_cap=soft_cap, tree_mask=bits)
    twin = reference.paged_attention_reference(*args, scale, logits_soft_cap=soft_cap, tree_mask=bits)
    torch.testing.assert_close(out, twin, atol=2e-5, rtol=1e-5)
    if soft_cap is None:
        torch.testing.assert_close(out, _dense_tree_attention(*args, scale, parents_of), atol=2e-5, rtol=1e-5)
    # Causal rows in the same call are the plain kernel's bits exactly (the chain path is unchanged).
    plain = paged_attention_cpu(*args, scale, logits_soft_cap=soft_cap)
    causal_rows = bits == 0
    assert torch.equal(out[causal_rows], plain[causal_rows])


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_kernel_refuses_a_bad_tree_mask():
    args, bits, _ = _batch(4, 1, 1, 16)
    bad = bits.clone()
    bad[1] = 0b100  # row 1 of the first tree sees a later row and not itself
    with pytest.raises(RuntimeError, match="tree row"):
        paged_attention_cpu(*args, 0.25, tree_mask=bad)
    with pytest.raises(RuntimeError, match="sliding_window"):
        paged_attention_cpu(*args, 0.25, tree_mask=bits, sliding_window=4)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_kernel_equals_dense_tree_attention(block_size, num_kv_splits):
    triton_attention = pytest.importorskip("kernels.triton_attention", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args, bits, parents_of = _batch(block_size, num_kv_heads=2, num_queries_per_kv=3, head_size=16)
    scale = 16**-0.5
    out = triton_attention.paged_attention_triton(
        *(t.to(device) for t in args), scale, num_kv_splits=num_kv_splits, tree_mask=bits.to(device)
    )
    torch.testing.assert_close(out.cpu(), _dense_tree_attention(*args, scale, parents_of), atol=2e-5, rtol=1e-5)

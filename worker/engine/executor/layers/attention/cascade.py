"""Cascade (shared-prefix) attention: a prefix many sequences of the batch share is attended once.

When many sequences of a step share their first KV blocks (prefix caching hands every line of a
few-shot job the same physical blocks for the preamble), attention splits in two, as in FlashInfer's
cascade inference (Ye et al. 2024, "Cascade Inference: Memory Bandwidth Efficient Shared Prefix Batch
Decoding") and vLLM's cascade attention:

1. every query token of the group attends the shared prefix in one dense, unmasked attention call
   (all queries come after the prefix, so no mask): the prefix K/V are read once per step instead of
   once per sequence, and the work runs as blocked matrix products;
2. each token attends its own sequence's remaining context (causal) through the paged kernel;
3. the two partial results are merged exactly by their log-sum-exps (as FlashAttention's split-KV
   reduction, Dao 2023).

Output equals one attention over the whole context up to float32 rounding. Each group of sequences
behind the same preamble gets its own cascade (:func:`shared_prefix_groups`); the others attend their
whole context through the kernel.
"""

from __future__ import annotations

import torch

from worker.engine.executor.layers.attention.kv_cache import KVCache, gather_kv_blocks

# vLLM's thresholds (use_cascade_attention): below them the extra calls cost more than they save.
MIN_SHARED_TOKENS = 256
MIN_SEQS = 8


def num_shared_prefix_blocks(block_tables: torch.Tensor, num_computed: list[int], block_size: int) -> int:
    """Leading blocks that every sequence shares (same physical ids) and has fully computed before this step.

    Args:
        block_tables: int ``[num_seqs, max_num_blocks]`` (padding past each table is ignored).
        num_computed: tokens each sequence had in the cache before this step's queries.
        block_size: tokens per block.

    Returns:
        The number of shared leading blocks, 0 when there is a single sequence or none are shared.
    """
    if block_tables.shape[0] < 2:
        return 0
    limit = min(num_computed) // block_size
    if limit == 0:
        return 0
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)
    mismatch = torch.nonzero(~same)
    return int(mismatch[0, 0]) if mismatch.numel() else limit


def shared_prefix_groups(
    block_tables: torch.Tensor, num_computed: list[int], block_size: int
) -> list[tuple[list[int], int]]:
    """Groups of sequences that share a long enough computed prefix for cascade attention.

    Sequences are grouped by their first physical block (prefix caching gives every line behind the same
    preamble the same blocks); a group counts when it has at least ``MIN_SEQS`` sequences whose common
    computed prefix (:func:`num_shared_prefix_blocks`) is at least ``MIN_SHARED_TOKENS`` tokens. A job
    with several preambles thus gets one cascade per preamble.

    Args:
        block_tables: int ``[num_seqs, max_num_blocks]``.
        num_computed: tokens each sequence had in the cache before this step's queries.
        block_size: tokens per block.

    Returns:
        ``(seq_ids, num_shared_blocks)`` per group, groups in order of their first sequence.
    """
    min_blocks = -(-MIN_SHARED_TOKENS // block_size)
    by_first_block: dict[int, list[int]] = {}
    for seq_id, (first_block, computed) in enumerate(zip(block_tables[:, 0].tolist(), num_computed)):
        if computed >= min_blocks * block_size:
            by_first_block.setdefault(first_block, []).append(seq_id)
    groups = []
    for seq_ids in by_first_block.values():
        if len(seq_ids) < MIN_SEQS:
            continue
        ids = torch.tensor(seq_ids)
        num_blocks = num_shared_prefix_blocks(block_tables[ids], [num_computed[i] for i in seq_ids], block_size)
        if num_blocks >= min_blocks:
            groups.append((seq_ids, num_blocks))
    return groups


def prefix_attention(
    query: torch.Tensor,
    kv_cache: KVCache,
    prefix_block_ids: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row attends all positions of the given blocks (no mask).

    With ``logits_soft_cap`` (Gemma 2) the scaled scores become ``cap * tanh(s / cap)``; the fused CPU flash
    kernel has no soft-cap, so that case runs as float32 matrix products.

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` or a quantized cache (the prefix's
            blocks are dequantized as they are gathered).
        prefix_block_ids: ``LongTensor[num_prefix_blocks]``, the prefix's blocks in order.
        scale: multiplier of ``q . k``.
        logits_soft_cap: the soft-cap (``> 0``), or None.

    Returns:
        ``(out, lse)``: ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` and float32
        ``[num_tokens, num_heads]`` log-sum-exps of the scaled scores.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    r = num_heads // num_kv_heads
    kv = gather_kv_blocks(kv_cache, prefix_block_ids, query.dtype).view(2, -1, num_kv_heads, head_size).transpose(1, 2)
    # The r query heads of a KV head become query rows: [1, num_kv_heads, num_tokens * r, head_size].
    q = query.view(num_tokens, num_kv_heads, r, head_size).transpose(0, 1).reshape(1, num_kv_heads, -1, head_size)
    if logits_soft_cap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), 0.0, False, scale=scale
        )
    else:
        scores = torch.matmul(q.float(), kv[0].unsqueeze(0).float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), kv[1].unsqueeze(0).float()).to(query.dtype)
    out = out.view(num_kv_heads, num_tokens, r, head_size).transpose(0, 1).reshape(num_tokens, num_heads, head_size)
    lse = lse.view(num_kv_heads, num_tokens, r).transpose(0, 1).reshape(num_tokens, num_heads)
    return out, lse.float()


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine two attentions of the same queries over disjoint key sets into the attention over both.

    ``out_*``: ``[num_tokens, num_heads, head_size]``; ``lse_*``: float32 ``[num_tokens, num_heads]``.
    Returns ``[num_tokens, num_heads, head_size]`` in ``out_a.dtype``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)

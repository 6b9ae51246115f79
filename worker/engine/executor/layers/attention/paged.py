"""Paged attention over a flat ragged batch: store the step's K/V, then run each row's planned path.

Executes the step's :class:`~.plan.AttentionPlan` (on CUDA the Triton kernels for the whole batch; on CPU
fresh prompts through the C++ causal kernel (or causal SDPA without the kernels), the C++ paged kernel for decode
rows, short extends and batch-invariant sequences, gathered SDPA groups, or cascade attention): see :mod:`.plan`
for the paths and :mod:`.metadata` for the batch layout (Kwon et al. 2023, PagedAttention; vLLM's ragged batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_attention import causal_attention_cpu, paged_attention_cpu
from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_kv_store import kv_store_cpu
from worker.engine.executor.layers.attention import cascade as cascade_attention
from worker.engine.executor.layers.attention.kv_cache import (
    KVCache,
    QuantizedKVCache,
    gather_kv_blocks,
    kv_cache_data_and_scales,
)
from worker.engine.executor.layers.attention.metadata import AttentionMetadata
from worker.engine.executor.layers.attention.plan import AttentionPlan, CascadePlan, GroupPlan, TritonPlan


def soft_capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    logits_soft_cap: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with Gemma 2's soft-cap, ``cap * tanh(s / cap)`` on the scaled scores
    before the mask (SDPA has no soft-cap), in float32 matrix products.

    Args:
        q: ``[..., L, D]``; k, v: ``[..., S, D]`` (leading dims broadcast as in ``torch.matmul``).
        scale: multiplier of ``q . k``; logits_soft_cap: the cap (``> 0``).
        attn_mask: additive ``[..., L, S]`` (0 or -inf), or None.
        is_causal: hide keys after each query (row ``i`` sees keys ``0 .. i + S - L``).

    Returns:
        ``[..., L, D]`` in ``q.dtype``.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if attn_mask is not None:
        scores = scores + attn_mask
    if is_causal:
        num_queries, num_keys = scores.shape[-2:]
        hidden = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).triu(num_keys - num_queries + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _attend_group(
    query: torch.Tensor,
    kv_cache: KVCache,
    group: GroupPlan,
    block_size: int,
    scale: float,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """Attention for one group; returns ``[num_group_tokens, num_heads, head_size]`` in ``token_idx`` order."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    num_queries_per_kv = num_heads // num_kv_heads
    num_seqs, max_query_len = group.query_idx.shape
    context_len = group.num_blocks * block_size

    # [G, max_q, Hkv, r, D] -> [G, Hkv, r * max_q, D]: the r query heads of a KV head become query rows.
    q = query.index_select(0, group.query_idx.view(-1)).view(
        num_seqs, max_query_len, num_kv_heads, num_queries_per_kv, head_size
    )
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, num_queries_per_kv * max_query_len, head_size)

    kv = gather_kv_blocks(kv_cache, group.flat_block_ids, query.dtype).view(
        2, num_seqs, context_len, num_kv_heads, head_size
    )
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(
            q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=group.mask, scale=scale
        )
    else:
        out = soft_capped_attention(
            q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), scale, logits_soft_cap, attn_mask=group.mask
        )
    out = out.view(num_seqs, num_kv_heads, num_queries_per_kv, max_query_len, head_size)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs * max_query_len, num_heads, head_size)
    if group.valid_rows is not None:
        out = out.index_select(0, group.valid_rows)
    return out


def _attend_fresh(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, logits_soft_cap: float | None
) -> torch.Tensor:
    """Causal attention of one sequence whose context is exactly its new tokens: straight from this step's
    K/V, no cache read, no mask tensor (the causal flash kernel skips the masked half)."""
    num_queries_per_kv = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)
    k = key.transpose(0, 1).repeat_interleave(num_queries_per_kv, dim=0)
    v = value.transpose(0, 1).repeat_interleave(num_queries_per_kv, dim=0)
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    else:
        out = soft_capped_attention(q[None], k[None], v[None], scale, logits_soft_cap, is_causal=True)
    return out[0].transpose(0, 1)


def _attend_cascade(
    query: torch.Tensor, kv_cache: KVCache, cascade: CascadePlan, scale: float, logits_soft_cap: float | None
) -> torch.Tensor:
    suffix = cascade.suffix
    suffix_lse = torch.empty(query.shape[:2], dtype=torch.float32)
    kv_data, kv_scales = kv_cache_data_and_scales(kv_cache)
    out = paged_attention_cpu(
        query,
        kv_data,
        suffix.query_start_loc,
        suffix.seq_lens,
        suffix.block_tables,
        scale,
        lse_out=suffix_lse,
        logits_soft_cap=logits_soft_cap,
        kv_scales=kv_scales,
        tree_mask=suffix.tree_mask,
    )
    for group in cascade.groups:
        rows = group.token_idx
        if rows is None:
            prefix_out, prefix_lse = cascade_attention.prefix_attention(
                query, kv_cache, group.prefix_block_ids, scale, logits_soft_cap
            )
            return cascade_attention.merge_attention_states(out, suffix_lse, prefix_out, prefix_lse)
        prefix_out, prefix_lse = cascade_attention.prefix_attention(
            query.index_select(0, rows), kv_cache, group.prefix_block_ids, scale, logits_soft_cap
        )
        merged = cascade_attention.merge_attention_states(
            out.index_select(0, rows), suffix_lse.index_select(0, rows), prefix_out, prefix_lse
        )
        out.index_copy_(0, rows, merged)
    return out


def _attend_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    attn_metadata: AttentionMetadata,
    triton_plan: TritonPlan,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    # NOTE: imported here so that CPU engines never import triton (it is an optional dependency).
    from kernels.triton_attention import paged_attention_triton, reshape_and_cache_triton

    kv_data, kv_scales = kv_cache_data_and_scales(kv_cache)
    reshape_and_cache_triton(key, value, kv_data, attn_metadata.slot_mapping, kv_scales=kv_scales)
    return paged_attention_triton(
        query,
        kv_data,
        attn_metadata.query_start_loc,
        attn_metadata.seq_lens,
        attn_metadata.block_tables,
        scale,
        max_query_len=triton_plan.max_query_len,
        max_seq_len=triton_plan.max_seq_len,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        kv_scales=kv_scales,
        tree_mask=attn_metadata.tree_mask,
    )


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    *,
    return_stored: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store new K/V at their slots in one indexed copy each (vectorised ``reshape_and_cache``; a quantized
    cache quantizes them on the way, :meth:`QuantizedKVCache.write`).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, contiguous, or a
            :class:`QuantizedKVCache`; mutated.
        slot_mapping: ``LongTensor[num_tokens]`` of distinct valid slots.
        return_stored: return what was stored (a quantized cache then dequantizes it).

    Returns:
        with ``return_stored``, ``(key, value)`` as later reads will see them: the arguments themselves for a
        float cache, their dequantized stored values for a quantized one; else None.
    """
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.write(key, value, slot_mapping, return_stored=return_stored)
    if (
        kv_cache.device.type == "cpu"
        and key.dtype == value.dtype == kv_cache.dtype
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels_available()
    ):
        # NOTE: the copies below without index_copy_'s per-call cost (kernels/cpu_kv_store.cpp)
        kv_store_cpu(kv_cache, key, value, slot_mapping.contiguous())
        return (key, value) if return_stored else None
    flat_cache = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat_cache[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
    return (key, value) if return_stored else None


def paged_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    attn_metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend every query over its sequence's context.

    Causal: query row ``i`` of a sequence with ``query_len`` new tokens and ``seq_len`` context tokens
    sits at position ``seq_len - query_len + i`` and sees positions ``0 ..`` that one; a sliding-window
    layer sees only the last ``sliding_window`` of them, itself included (Hugging Face's mask:
    ``q_pos - k_pos < sliding_window``), through the step's ``sliding_plan``. Grouped-query
    attention when ``num_heads`` is a multiple of ``num_kv_heads`` (query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``, as Hugging Face's ``repeat_kv``).

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, or a :class:`QuantizedKVCache`
            (every path then attends the dequantized stored values, the step's own K/V included, with keys
            and queries smoothed, :meth:`QuantizedKVCache.smooth`); mutated (new K/V stored). Slots never
            written must hold finite numbers (allocate with ``torch.zeros``): whole blocks are gathered and
            masked, and ``0 * NaN`` would poison a row.
        attn_metadata: the step's :class:`AttentionMetadata`, its plan built for this model's shapes.
        scale: multiplier of ``q . k``, usually ``head_size ** -0.5``.
        sliding_window: this layer's window, None for a global layer; must be the metadata's
            ``sliding_window``.
        logits_soft_cap: cap the scaled scores at ``cap * tanh(s / cap)`` (Gemma 2), or None.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    if isinstance(kv_cache, QuantizedKVCache):
        query, key = kv_cache.smooth(query, key)
    plan: AttentionPlan | None = attn_metadata.plan
    if sliding_window is not None:
        assert attn_metadata.sliding_window == sliding_window, "metadata built for another sliding window"
        plan = attn_metadata.sliding_plan
    assert plan is not None
    soft_cap = logits_soft_cap
    if plan.triton is not None:
        return _attend_triton(
            query, key, value, kv_cache, attn_metadata, plan.triton, scale, plan.sliding_window, soft_cap
        )
    quantized = isinstance(kv_cache, QuantizedKVCache)
    # NOTE: only a fresh prefill attends this step's K/V directly (but a quantized cache's through the paged kernel).
    stored = write_to_kv_cache(
        key,
        value,
        kv_cache,
        attn_metadata.slot_mapping,
        return_stored=bool(plan.fresh_prefills) and not (quantized and plan.fresh_runs),
    )
    if stored is not None:
        key, value = stored
    block_size = plan.block_size
    assert kv_cache.shape[2] == block_size and query.shape[1] == plan.num_queries_per_kv * kv_cache.shape[3]
    if plan.cascade is not None:
        return _attend_cascade(query, kv_cache, plan.cascade, scale, soft_cap)
    if plan.covers_batch_in_order:
        return _attend_group(query, kv_cache, plan.groups[0], block_size, scale, soft_cap)
    kernel = plan.kernel

    def attend_kernel(rows: torch.Tensor) -> torch.Tensor:
        assert kernel is not None
        kv_data, kv_scales = kv_cache_data_and_scales(kv_cache)
        return paged_attention_cpu(
            rows,
            kv_data,
            kernel.query_start_loc,
            kernel.seq_lens,
            kernel.block_tables,
            scale,
            sliding_window=plan.sliding_window,
            logits_soft_cap=soft_cap,
            kv_scales=kv_scales,
            tree_mask=kernel.tree_mask,
        )

    if kernel is not None and kernel.token_idx is None:
        return attend_kernel(query)
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.fresh_runs:
        for run in plan.fresh_runs:
            rows = slice(run.start, run.end)
            if quantized:
                # NOTE: a quantized cache's fresh prompts go to the paged kernel over the stored values (the same
                # numbers as the causal kernel up to float32 rounding), where its agreement floors were measured.
                kv_data, kv_scales = kv_cache_data_and_scales(kv_cache)
                output[rows] = paged_attention_cpu(
                    query[rows],
                    kv_data,
                    run.cu_seqlens,
                    run.seq_lens,
                    run.block_tables,
                    scale,
                    sliding_window=plan.sliding_window,
                    logits_soft_cap=soft_cap,
                    kv_scales=kv_scales,
                )
            else:
                causal_attention_cpu(
                    query[rows],
                    key[rows],
                    value[rows],
                    run.cu_seqlens,
                    scale,
                    logits_soft_cap=soft_cap,
                    out=output[rows],
                )
    else:
        for start, end in plan.fresh_prefills:
            output[start:end] = _attend_fresh(query[start:end], key[start:end], value[start:end], scale, soft_cap)
    if kernel is not None:
        assert kernel.token_idx is not None  # a kernel plan covering the whole batch returned above
        output.index_copy_(0, kernel.token_idx, attend_kernel(query.index_select(0, kernel.token_idx)))
    for group in plan.groups:
        output.index_copy_(0, group.token_idx, _attend_group(query, kv_cache, group, block_size, scale, soft_cap))
    return output

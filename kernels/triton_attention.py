"""Triton kernels of the paged KV cache: attention over a block table, KV store, block copy.

Same layout as :mod:`kernels.reference` (vLLM's): ``kv_cache: [2, num_blocks, block_size, num_kv_heads,
head_size]``, slot ``= block_id * block_size + offset``. Each kernel has a plain PyTorch twin there with the
same contract; CUDA runs these, CPU runs the twins (tests compare the two under ``TRITON_INTERPRET=1``).

- :func:`paged_attention_triton`: one program per (sequence, KV head, tile of query tokens). The tile's
  rows are (query token, query head of that KV head) pairs, so the ``num_heads // num_kv_heads`` query
  heads of a group share every K/V load (grouped-query attention). K/V are read through the block table
  in tiles of ``BLOCK_N`` positions (a tile may span several blocks), with an online softmax in float32
  (Milakov and Gimelshein 2018; Dao et al. 2022, FlashAttention) and a causal bound that stops at the
  tile's last visible position. One kernel serves decode, extend (k + 1 tokens after a cached context)
  and prefill rows of one ragged batch. A sliding window starts the loop at the tile's first visible
  position (blocks before it are never read) and masks per row; a soft-cap maps each scaled score ``s`` to
  ``cap * tanh(s / cap)`` (Gemma 2); a token-tree mask (speculative verification of a draft tree, Miao et
  al. 2023, "SpecInfer") hides the query rows that are not a row's ancestors. All three are compile-time
  switches: off, the kernel is unchanged.
- :func:`reshape_and_cache_triton`: store new K/V through ``slot_mapping`` (vLLM's ``reshape_and_cache``).
- A quantized cache (int8 or float8 e4m3 elements with float32 ``kv_scales: [2, num_blocks, block_size,
  num_kv_heads, num_groups]``, :func:`kernels.reference.quantize_kv`): the store quantizes each (token, KV
  head, group of ``head_size // num_groups`` channels) by its absmax; attention dequantizes each K/V tile
  as it is loaded (element times its group's scale, in float32, then the compute dtype: the values a fresh
  prompt attends, ``QuantizedKVCache.write``), so the blocks are read in place.
- :func:`copy_blocks_triton`: copy-on-write block copies, all pairs in one launch.

Every load and store is masked; block ids and token offsets are widened to int64 before they are
multiplied by a stride, so caches of more than 2**31 elements address correctly.
This module imports nothing of batchinfer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    cache_ptr,
    scales_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tree_mask_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_skv,
    stride_sb,
    stride_ss,
    stride_sh,
    scale_group_size,
    stride_bt,
    stride_ls,
    stride_lt,
    num_queries_per_kv,
    head_size,
    block_size,
    num_kv_splits,
    split_len,
    sliding_window,
    soft_cap,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LSE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_TREE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // num_kv_splits
    split_idx = tl.program_id(2) % num_kv_splits
    query_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_start = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_in_seq = q_tile * BLOCK_Q + rows // BLOCK_H
    head_in_group = rows % BLOCK_H
    row_valid = (q_in_seq < query_len) & (head_in_group < num_queries_per_kv)
    # NOTE: padding rows take the last real query's position so they always see a key (no 0/0 in the
    # softmax); they are never stored.
    q_pos = context_start + tl.minimum(q_in_seq, query_len - 1)
    token_idx = (query_start + q_in_seq).to(tl.int64)
    head_idx = (kv_head * num_queries_per_kv + head_in_group).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_size

    q_ptrs = query_ptr + token_idx[:, None] * stride_qt + head_idx[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if HAS_TREE:
        # Bit j: the row sees query row j (0: a causal row; padding rows load 0 and stay causal).
        tree_bits = tl.load(tree_mask_ptr + token_idx, mask=row_valid, other=0)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_D], dtype=tl.float32)

    # The tile's last query sees positions up to context_start + its index: nothing beyond is read.
    # With split-KV, this program reads only its split's part of that range (possibly none of it).
    kv_start_of_split = split_idx * split_len
    kv_end = tl.minimum(tl.minimum(seq_len, context_start + (q_tile + 1) * BLOCK_Q), kv_start_of_split + split_len)
    kv_begin = kv_start_of_split
    if HAS_WINDOW:
        # The tile's first query sees nothing before its window: those positions are not read.
        kv_begin = tl.maximum(kv_begin, context_start + q_tile * BLOCK_Q - sliding_window + 1)
    table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        positions = kv_start + tl.arange(0, BLOCK_N)
        pos_valid = positions < kv_end
        block_ids = tl.load(table_row + positions // block_size, mask=pos_valid, other=0).to(tl.int64)
        slot_offsets = block_ids * stride_cb + (positions % block_size).to(tl.int64) * stride_cs + head_offset
        kv_mask = pos_valid[None, :] & dim_valid[:, None]
        k = tl.load(cache_ptr + slot_offsets[None, :] + dims[:, None], mask=kv_mask, other=0.0)  # [D, N]
        if QUANTIZED:
            # Each element times its (position, channel group)'s scale, in float32, then the compute dtype.
            scale_offsets = (
                block_ids * stride_sb + (positions % block_size).to(tl.int64) * stride_ss + kv_head * stride_sh
            )
            groups = dims // scale_group_size
            k_scales = tl.load(scales_ptr + scale_offsets[None, :] + groups[:, None], mask=kv_mask, other=0.0)
            k = (k.to(tl.float32) * k_scales).to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            # cap * tanh(s / cap), tanh from one exp of a non-positive argument (no overflow).
            capped = scores / soft_cap
            decay = tl.exp(-2.0 * tl.abs(capped))
            magnitude = (1.0 - decay) / (1.0 + decay)
            scores = soft_cap * tl.where(capped >= 0, magnitude, -magnitude)
        visible = (positions[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > q_pos[:, None] - sliding_window)
        if HAS_TREE:
            query_row = tl.minimum(tl.maximum(positions - context_start, 0), 63).to(tl.int64)
            row_bit = (tree_bits[:, None] >> query_row[None, :]) & 1
            in_query = positions[None, :] >= context_start
            visible = visible & ((tree_bits[:, None] == 0) | ~in_query | (row_bit != 0))
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # NOTE: a row that sees no key yet (a later split's rows, or rows before their first visible key)
        # keeps m = -inf; shifting by 0 instead keeps exp(-inf - -inf) = NaN out of it.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = pos_valid[:, None] & dim_valid[None, :]
        v = tl.load(cache_ptr + stride_ckv + slot_offsets[:, None] + dims[None, :], mask=v_mask, other=0.0)
        if QUANTIZED:
            v_scales = tl.load(
                scales_ptr + stride_skv + scale_offsets[:, None] + groups[None, :], mask=v_mask, other=0.0
            )
            v = (v.to(tl.float32) * v_scales).to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # A split that saw no key of a row leaves it out = 0, lse = -inf: zero weight in the merge.
    has_keys = l_i > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    out_ptrs = (
        out_ptr + split_idx * stride_os + token_idx[:, None] * stride_ot + head_idx[:, None] * stride_oh + dims[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    if HAS_LSE:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split_idx * stride_ls + token_idx * stride_lt + head_idx, lse, mask=row_valid)


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size] with unit stride in head_size, "
            f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )


def _check_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    quantized = kv_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    if (kv_scales is not None) != quantized:
        raise ValueError(f"kv_scales are required with (only with) an int8 or float8 cache, got {kv_cache.dtype}")
    if kv_scales is not None and (
        kv_scales.dtype != torch.float32
        or kv_scales.dim() != 5
        or kv_scales.shape[:4] != kv_cache.shape[:4]
        or kv_cache.shape[4] % kv_scales.shape[4]
        or not kv_scales.is_contiguous()
    ):
        raise ValueError(
            f"kv_scales must be contiguous float32 {tuple(kv_cache.shape[:4])} + (num_groups,), num_groups dividing "
            f"head_size {kv_cache.shape[4]}, got {tuple(kv_scales.shape)}"
        )


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    lse_out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a ragged batch (decode, extend and prefill rows) over a block table.

    Same contract as :func:`kernels.reference.paged_attention_reference`: sequence ``s`` owns query rows
    ``query_start_loc[s] : query_start_loc[s + 1]``, the last ``query_len`` positions of its
    ``seq_lens[s]``-token context (already in the cache); query row ``i`` sees positions up to
    ``seq_lens[s] - query_len + i`` (with ``sliding_window``, only the last ``sliding_window`` of them, itself
    included; earlier positions are not read). ``logits_soft_cap`` maps each scaled score ``s`` to
    ``cap * tanh(s / cap)``. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Scores, softmax and the output accumulator are float32 (float32 inputs use IEEE products, not TF32).

    Args:
        query: float32/float16/bfloat16 ``[num_tokens, num_heads, head_size]``, unit stride in the last dim.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` in ``query.dtype`` (or int8 /
            float8_e4m3fn with ``kv_scales``), unit stride in the last dim; ``block_size`` a power of two.
        query_start_loc: integer ``[num_seqs + 1]`` prefix sums of the query lengths.
        seq_lens: integer ``[num_seqs]`` context lengths including this step's tokens.
        block_tables: integer ``[num_seqs, max_num_blocks_per_seq]`` physical block ids (padding ignored).
        scale: multiplier of ``q . k``.
        lse_out: optional float32 ``[num_tokens, num_heads]`` (unit stride in heads), filled with each row's
            log-sum-exp of its scaled scores.
        max_query_len: the longest query in the batch; computed from ``query_start_loc`` (a device sync on
            CUDA) when not given.
        max_seq_len: the longest context in the batch (host int); lets :func:`choose_num_kv_splits` pick a
            split-KV launch when ``num_kv_splits`` is None (without it, no split).
        num_kv_splits: split each sequence's context into this many parts, one program each, merged through
            their log-sum-exps (split-KV, "flash-decoding": fills the GPU when few sequences have long contexts).
        sliding_window: keys each query sees (``>= 1``), or None for the whole causal context.
        logits_soft_cap: soft-cap of the scaled scores (``> 0``), or None.
        kv_scales: contiguous float32 ``[2, num_blocks, block_size, num_kv_heads, num_groups]`` of a quantized
            cache (an element stands for ``element * scale`` of its group of ``head_size // num_groups``
            channels); None for a cache in ``query.dtype``.
        tree_mask: int64 ``[num_tokens]``, the token-tree mask of speculative verification (as
            :func:`kernels.reference.paged_attention_reference`: 0 = causal row; else bit ``j`` lets the row see
            its sequence's query row ``j``); None: every row causal. Not with ``sliding_window``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.

    Raises:
        ValueError: on a cache of the wrong layout, a dtype mismatch, scales missing or misshaped, a block size not a power of two, a
            window below 1, a soft-cap not above 0, or a tree mask not int64 or beside a window.
    """
    _check_cache(kv_cache)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
    if tree_mask is not None and (sliding_window is not None or tree_mask.dtype != torch.int64):
        raise ValueError("tree_mask must be int64 and cannot be combined with sliding_window")
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    _check_scales(kv_cache, kv_scales)
    if (kv_scales is None and query.dtype != kv_cache.dtype) or query.stride(2) != 1:
        raise ValueError(f"query ({query.dtype}, strides {query.stride()}) must match the cache dtype {kv_cache.dtype}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    num_queries_per_kv = num_heads // num_kv_heads
    output = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_h = triton.next_power_of_2(num_queries_per_kv)
    # tl.dot needs at least 16 rows: a tile holds at least 16 (query token, head) pairs.
    block_q = max(1, 16 // block_h)
    block_d = max(16, triton.next_power_of_2(head_size))
    block_n = max(16, block_size)
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    if num_kv_splits is None:
        num_kv_splits = 1
        if max_seq_len is not None and query.is_cuda:
            num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
            num_kv_splits = choose_num_kv_splits(num_seqs * num_kv_heads * num_q_tiles, max_seq_len, num_sms)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")
    if num_kv_splits == 1:
        # One split covers any context: the kernel bounds the loop by the sequence itself.
        split_len = 2**31 - 1
        out_arg, lse_arg = output, (lse_out if lse_out is not None else output)
        stride_os, stride_ot, stride_oh = 0, output.stride(0), output.stride(1)
        stride_ls, stride_lt = 0, (lse_out.stride(0) if lse_out is not None else 0)
    else:
        longest = max_seq_len if max_seq_len is not None else int(seq_lens.max())
        split_len = triton.cdiv(triton.cdiv(longest, num_kv_splits), block_n) * block_n
        out_arg = torch.empty(num_kv_splits, num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
        lse_arg = torch.empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)
        stride_os, stride_ot, stride_oh = out_arg.stride(0), out_arg.stride(1), out_arg.stride(2)
        stride_ls, stride_lt = lse_arg.stride(0), lse_arg.stride(1)
    grid = (num_seqs, num_kv_heads, num_q_tiles * num_kv_splits)
    scales_arg = kv_scales if kv_scales is not None else kv_cache
    scale_strides = kv_scales.stride()[:4] if kv_scales is not None else (0, 0, 0, 0)
    scale_group_size = head_size // kv_scales.shape[4] if kv_scales is not None else head_size
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        scales_arg,
        out_arg,
        lse_arg,
        query_start_loc,
        seq_lens,
        block_tables,
        tree_mask if tree_mask is not None else seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        stride_os,
        stride_ot,
        stride_oh,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        *scale_strides,
        scale_group_size,
        block_tables.stride(0),
        stride_ls,
        stride_lt,
        num_queries_per_kv,
        head_size,
        block_size,
        num_kv_splits,
        split_len,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_LSE=lse_out is not None or num_kv_splits > 1,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        HAS_TREE=tree_mask is not None,
        QUANTIZED=kv_scales is not None,
        # NOTE: float32 products in IEEE precision, not TF32 (Triton's CUDA default), to match the twin;
        # the setting only matters for float32 operands.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if num_kv_splits > 1:
        # Exact merge of the partial softmaxes: lse = logsumexp_s lse_s, out = sum_s exp(lse_s - lse) out_s.
        lse = torch.logsumexp(lse_arg, dim=0)
        weights = torch.exp(lse_arg - lse)
        output.copy_((out_arg * weights[..., None]).sum(dim=0))
        if lse_out is not None:
            lse_out.copy_(lse)
    return output


def choose_num_kv_splits(num_programs: int, max_seq_len: int, num_sms: int, min_split_len: int = 256) -> int:
    """How many KV splits fill the GPU: enough programs for about two per SM, each split at least
    ``min_split_len`` positions of the longest context; 1 when the batch alone fills the GPU."""
    if num_programs >= num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // num_programs), max_seq_len // min_split_len))


@triton.jit
def _quantize_and_store(x, dst_ptrs, scale_ptrs, mask, q_max, ROUND_TO_INT: tl.constexpr):
    """The twin's quantize_kv on a [heads, group's dims] tile: scale = absmax / q_max per head (1 for all zeros)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    scales = tl.where(amax > 0, amax / q_max, 1.0)
    y = tl.minimum(tl.maximum(x / scales[:, None], -q_max), q_max)
    if ROUND_TO_INT:
        y = tl.where(y < 0, -tl.floor(-y + 0.5), tl.floor(y + 0.5))
    tl.store(dst_ptrs, y.to(dst_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptrs, scales, mask=tl.max(mask.to(tl.int32), axis=1) > 0)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    scales_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_skv,
    num_kv_heads,
    head_size,
    block_size,
    q_max,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    QUANTIZED: tl.constexpr,
    ROUND_TO_INT: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads[:, None] * stride_ch
    if QUANTIZED:
        # One [heads, group] tile per channel group; scales: contiguous [2, num_slots, num_kv_heads, NUM_GROUPS].
        group_size = head_size // NUM_GROUPS
        in_group = tl.arange(0, BLOCK_G)
        mask = (heads[:, None] < num_kv_heads) & (in_group[None, :] < group_size)
        for group in tl.static_range(NUM_GROUPS):
            dims = group * group_size + in_group
            key = tl.load(key_ptr + token_idx * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
            value = tl.load(value_ptr + token_idx * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
            dst = cache_ptr + row + dims[None, :]
            scale_ptrs = scales_ptr + (slot * num_kv_heads + heads) * NUM_GROUPS + group
            _quantize_and_store(key, dst, scale_ptrs, mask, q_max, ROUND_TO_INT)
            _quantize_and_store(value, dst + stride_ckv, scale_ptrs + stride_skv, mask, q_max, ROUND_TO_INT)
    else:
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)
        dst = row + dims[None, :]
        key = tl.load(key_ptr + token_idx * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        value = tl.load(value_ptr + token_idx * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(cache_ptr + dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + stride_ckv + dst, value.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store each new token's K and V at its slot (twin: :func:`kernels.reference.reshape_and_cache`; quantized,
    :func:`kernels.reference.quantize_kv` then the store).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, unit stride in the last dim (views of a
            fused QKV projection are fine); cast to the cache dtype on store.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, unit stride in the last dim;
            mutated in place; int8 or float8_e4m3fn with ``kv_scales`` to quantize on store.
        slot_mapping: integer ``[num_tokens]`` distinct slots, each in ``[0, num_blocks * block_size)``.
        kv_scales: contiguous float32 ``[2, num_blocks, block_size, num_kv_heads, num_groups]`` of a quantized
            cache (mutated: each stored group's scale), or None.

    Raises:
        ValueError: on a cache of the wrong layout, scales missing or misshaped, or K/V without unit stride
            in the last dim.
    """
    _check_cache(kv_cache)
    _check_scales(kv_cache, kv_scales)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value need unit stride in head_size")
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    num_groups = kv_scales.shape[4] if kv_scales is not None else 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        kv_scales if kv_scales is not None else kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_scales.stride(0) if kv_scales is not None else 0,
        num_kv_heads,
        head_size,
        kv_cache.shape[2],
        127.0 if kv_cache.dtype == torch.int8 else 448.0,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
        NUM_GROUPS=num_groups,
        BLOCK_G=triton.next_power_of_2(head_size // num_groups),
        QUANTIZED=kv_scales is not None,
        ROUND_TO_INT=kv_cache.dtype == torch.int8,
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    stride_ckv,
    stride_cb,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair_idx = tl.program_id(0)
    kv_idx = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair_idx).to(tl.int64)
    dst = tl.load(dst_ptr + pair_idx).to(tl.int64)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    base = cache_ptr + kv_idx * stride_ckv
    data = tl.load(base + src * stride_cb + offsets, mask=mask)
    tl.store(base + dst * stride_cb + offsets, data, mask=mask)


def copy_blocks_triton(kv_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    """Copy K and V of block ``src_block_ids[i]`` onto block ``dst_block_ids[i]`` for every ``i`` in one launch
    (copy-on-write, Kwon et al. 2023 section 4.4; twin: :func:`kernels.reference.copy_blocks`).

    Args:
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, each block contiguous; mutated.
        src_block_ids, dst_block_ids: integer ``[num_pairs]``. Every destination distinct and none of them a
            source (copies run in parallel; the twin reads the cache as it was before the call).

    Raises:
        ValueError: on a cache whose blocks are not contiguous or mismatched id lengths.
    """
    _check_cache(kv_cache)
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    if kv_cache.stride(3) != head_size or kv_cache.stride(2) != num_kv_heads * head_size:
        raise ValueError(f"each block of kv_cache must be contiguous, got strides {kv_cache.stride()}")
    if src_block_ids.shape != dst_block_ids.shape or src_block_ids.dim() != 1:
        raise ValueError("src_block_ids and dst_block_ids must be 1-D and of one length")
    num_pairs = src_block_ids.shape[0]
    if num_pairs == 0:
        return
    block_numel = block_size * num_kv_heads * head_size
    chunk = min(1024, triton.next_power_of_2(block_numel))
    grid = (num_pairs, 2, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        kv_cache, src_block_ids, dst_block_ids, kv_cache.stride(0), kv_cache.stride(1), block_numel, BLOCK=chunk
    )

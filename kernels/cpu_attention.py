"""C++ attention for CPUs: paged attention that reads K/V from the cache blocks in place (decoders), bidirectional
attention over packed variable-length sequences (encoders), and causal attention over packed fresh prompts
(decoders' prefill).

The sources are ``cpu_attention.cpp`` and ``cpu_varlen_attention.cpp`` next to this file, built with the other CPU kernels by
:mod:`kernels.cpu_extension` (check :func:`kernels.cpu_extension.cpu_kernels_available` first).

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    lse_out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of every query token over its sequence's cached context (no K/V gather).

    Same contract as :func:`kernels.reference.paged_attention_reference`: sequence ``s`` owns query rows
    ``query_start_loc[s] : query_start_loc[s + 1]``, the last ``query_len`` positions of its
    ``seq_lens[s]``-token context (already in the cache); query row ``i`` sees positions up to
    ``seq_lens[s] - query_len + i`` (and, with ``sliding_window``, only the last ``sliding_window`` of them,
    itself included; earlier positions are not read, their blocks may be freed). ``logits_soft_cap`` caps
    the scaled scores at ``cap * tanh(s / cap)``. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Softmax is exact (two passes over the scores) in float32; slots outside a sequence's context are
    never read. Work is split over (query token, KV head) pairs, one run of about equal cost per
    ``torch.get_num_threads()`` thread; a token's result does not depend on the split.

    Args:
        query: float32 or bfloat16 ``[num_tokens, num_heads, head_size]`` on CPU, unit stride in the last dim
            (a strided view of a fused QKV projection is fine); bfloat16 is widened to float32 in the kernel, a
            token's heads as its work item reads them.
        kv_cache: contiguous ``[2, num_blocks, block_size, num_kv_heads, head_size]``: float32, bfloat16 (widened
            to float32 element by element as it is read), or a quantized
            cache (int8 or float8_e4m3fn, :func:`kernels.reference.quantize_kv`) read in place and converted
            to float32 row by row.
        query_start_loc: int32 ``[num_seqs + 1]`` prefix sums of the query lengths (from 0 to num_tokens).
        seq_lens: int32 ``[num_seqs]`` context lengths including this step's tokens.
        block_tables: int32 contiguous ``[num_seqs, max_num_blocks_per_seq]``.
        scale: multiplier of ``q . k``.
        lse_out: optional float32 contiguous ``[num_tokens, num_heads]``, filled with each row's
            log-sum-exp (natural log) of its scaled scores, for merging partial attention states.
        sliding_window: keys each query sees (``>= 1``), or None for the whole causal context.
        logits_soft_cap: soft-cap of the scaled scores (``> 0``), or None.
        kv_scales: float32 contiguous ``[2, num_blocks, block_size, num_kv_heads, num_groups]``, the scales of
            every stored (token, KV head, group of ``head_size // num_groups`` channels) of a quantized
            ``kv_cache`` (an element's value is ``element * scale`` of its group,
            :func:`kernels.reference.quantize_kv`); None for float32.
        tree_mask: contiguous int64 ``[num_tokens]``, the token-tree mask of speculative verification (as
            :func:`kernels.reference.paged_attention_reference`: 0 = causal row; else bit ``j`` lets the row
            see its sequence's query row ``j``, positions before the query stay visible); None: all causal.
            Not with ``sliding_window``.

    Returns:
        contiguous ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` (computed in float32; a bfloat16
        result is rounded once at the end).

    Raises:
        RuntimeError: when the kernels are unavailable (see :func:`kernels.cpu_extension.cpu_kernels_available`), or
            on bad shapes, dtypes, lengths or out-of-range block ids.
    """
    require_cpu_kernels()
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.batchinfer_cpu.paged_attention_(
        out,
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        lse_out,
        sliding_window,
        logits_soft_cap,
        kv_scales,
        tree_mask,
    )
    return out


def varlen_attention_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention of each packed sequence over its own tokens (an encoder's attention).

    Same contract as :func:`kernels.reference.varlen_attention_reference`: sequence ``s`` owns rows
    ``cu_seqlens[s] : cu_seqlens[s + 1]`` and each of its rows attends to all of them and nothing else
    (FlashAttention's ``cu_seqlens`` convention, Dao et al. 2022); no padding and no mask are built. Work is
    one item per (sequence, head), split into one run of about equal cost (``L ** 2``) per
    ``torch.get_num_threads()`` thread; per item, Q K^T and P V run as register-blocked tiles over a packed
    copy of the head's K (transposed) and V, with an exact two-pass float32 softmax (each row's max taken as
    its scores leave the registers, then ``exp(scale * (s - max))`` and the sum). A row's result does not
    depend on the other sequences of the call (batch invariant) nor on the thread count.

    Args:
        query, key, value: float32 CPU ``[num_tokens, num_heads, head_size]`` with unit stride in the last
            dimension (views into a fused QKV projection are fine); ``head_size`` a multiple of 8.
        cu_seqlens: int32 ``[num_seqs + 1]`` prefix sums of the sequence lengths, from 0 to ``num_tokens``,
            strictly increasing (no empty sequence).
        scale: multiplier of ``q . k``, positive.

    Returns:
        float32 contiguous ``[num_tokens, num_heads, head_size]``.

    Raises:
        RuntimeError: when the kernels are unavailable, on bad shapes, dtypes, strides or ``cu_seqlens``, or a
            scale that is not positive.
    """
    require_cpu_kernels()
    out = torch.empty(query.shape, dtype=torch.float32)
    torch.ops.batchinfer_cpu.varlen_attention_(out, query, key, value, cu_seqlens, scale)
    return out


def causal_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each packed sequence over its own tokens: a decoder's fresh prompts, straight from
    the step's K/V (no cache read, no padding, no mask tensor).

    Sequence ``s`` owns rows ``cu_seqlens[s] : cu_seqlens[s + 1]``; its row ``i`` attends to its rows ``0 .. i``
    (FlashAttention's ``cu_seqlens`` convention, Dao et al. 2022). Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (grouped-query attention, Hugging Face's ``repeat_kv``). Work is one item
    per (sequence, KV head), split into one run of about equal cost per ``torch.get_num_threads()`` thread; per
    item, K (transposed) and V are widened to float32 and packed once for the KV head's query heads, whose rows
    are scored together in register tiles of up to 12 rows that stop at the block's causal bound, with an exact
    two-pass float32 softmax per row (docs/engine.md, "Attention metadata and plan"). A row's result does not
    depend on the other sequences of the call nor on the thread count; it differs from the paged kernel
    (:func:`paged_attention_cpu`) and from ``scaled_dot_product_attention`` by float32 rounding only.

    Args:
        query: float32 or bfloat16 CPU ``[num_tokens, num_heads, head_size]``; key, value: the same dtype,
            ``[num_tokens, num_kv_heads, head_size]``; unit stride in the last dimension (views into a fused QKV
            projection are fine); ``head_size`` a multiple of 8, ``num_heads`` a multiple of ``num_kv_heads``.
        cu_seqlens: int32 ``[num_seqs + 1]`` prefix sums of the sequence lengths, from 0 to ``num_tokens``,
            strictly increasing (no empty sequence).
        scale: multiplier of ``q . k``, positive.
        logits_soft_cap: cap the scaled scores at ``cap * tanh(s / cap)`` (Gemma 2, ``> 0``), or None.
        out: contiguous ``[num_tokens, num_heads, head_size]`` of query's dtype to write into, or None for a new one.

    Returns:
        ``out`` (or a new contiguous tensor like it), in ``query.dtype``: computed in float32, a bfloat16 result
        rounded once at the end.

    Raises:
        RuntimeError: when the kernels are unavailable, on bad shapes, dtypes, strides or ``cu_seqlens``, or a
            scale or soft cap that is not positive.
    """
    require_cpu_kernels()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.batchinfer_cpu.causal_attention_(out, query, key, value, cu_seqlens, scale, logits_soft_cap)
    return out

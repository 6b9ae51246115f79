"""Paged attention over a flat ragged batch, vectorised with PyTorch (the CPU path).

The batch is vLLM's: all scheduled tokens of all sequences in one flat ``[num_tokens, ...]`` tensor,
sequence by sequence, no padding. Each sequence's new (query) tokens are the last ``query_len``
positions of its context; K/V of the whole context live in a paged cache read through the
sequence's block table (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention").

A sequence whose whole context is this step's tokens (a fresh prompt, not chunked, nothing cached)
attends straight from this step's K/V with one causal ``scaled_dot_product_attention`` call (no
gather, no padding, no mask: the causal flash kernel skips the upper triangle).

How the PyTorch path avoids per-sequence loops for the others: sequences are split into two groups,
decode rows (``query_len == 1``) and the rest (prefill chunks over a cached prefix or an earlier chunk,
speculative verification). For each group, one ``index_select`` gathers the whole blocks of every sequence into
a padded ``[num_group_seqs, num_blocks * block_size, num_kv_heads, head_size]`` tensor, and one
``scaled_dot_product_attention`` call runs over it with an additive mask (causal and length).
Grouped-query attention folds the ``num_heads // num_kv_heads`` query heads that share a KV head
into the query-length axis, so K/V are never repeated. The index tensors and masks depend only on
the batch, so they are built once per step (on the first layer) and reused by every layer.

On CPU in float32, decode rows go instead to the C++ kernel in ``kernels/cpu_attention.py``, which
reads K/V from the blocks in place (no gather); prefill rows stay on ``scaled_dot_product_attention``,
whose blocked matmuls beat the kernel's per-row loops there. When at least ``MIN_SEQS`` sequences
share their first ``MIN_SHARED_TOKENS``-plus tokens' blocks (a prefix-cached preamble), every row goes
through cascade attention instead (:mod:`worker.engine.executor.layers.attention.cascade`): each shared prefix once
for its group of sequences, every sequence's own remaining context through the kernel. ``BATCHINFER_CPU_KERNELS=0``, another
dtype or device, or a failed build (warned once) leave every row on the PyTorch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from kernels.cpu_attention import paged_attention_cpu
from kernels.cpu_extension import cpu_kernels_available
from worker.engine.executor.layers.attention import cascade as cascade_attention


@dataclass(slots=True)
class _GroupPlan:
    """Index tensors and mask for one group of sequences (decode rows, or all the others).

    ``query_idx``: ``[num_group_seqs, max_query_len]`` flat batch index of each query row (padding rows
    repeat a valid index); ``valid_rows``: ``[num_group_tokens]`` indices into the flattened
    ``num_group_seqs * max_query_len`` rows that are real (``None`` when no row is padding);
    ``token_idx``: ``[num_group_tokens]`` flat batch index of each real row, in the same order;
    ``flat_block_ids``: ``[num_group_seqs * num_blocks]`` physical blocks to gather, sequence-major;
    ``mask``: ``[num_group_seqs, 1, num_queries_per_kv * max_query_len, num_blocks * block_size]``
    additive (0 or -inf), in the query dtype.
    """

    query_idx: torch.Tensor
    valid_rows: torch.Tensor | None
    token_idx: torch.Tensor
    flat_block_ids: torch.Tensor
    mask: torch.Tensor
    max_query_len: int
    num_blocks: int


@dataclass(slots=True)
class _KernelPlan:
    """Decode rows for the C++ CPU kernel.

    ``token_idx``: ``[num_decode_seqs]`` flat batch index of each decode row (``None`` when the decode
    rows are the whole batch, in order); ``query_start_loc`` (``[num_decode_seqs + 1]``), ``seq_lens``
    and ``block_tables``: int32 metadata of those sequences only.
    """

    token_idx: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(slots=True)
class _CascadeGroup:
    """Rows of the sequences behind one shared prefix: ``prefix_block_ids`` (``LongTensor[num_shared_blocks]``)
    and ``token_idx`` (``LongTensor[num_group_tokens]``, ``None`` when the group is the whole batch)."""

    prefix_block_ids: torch.Tensor
    token_idx: torch.Tensor | None


@dataclass(slots=True)
class _CascadePlan:
    """``groups`` attend their shared prefix once each; ``suffix``: all rows for the C++ kernel, each
    sequence's block table and ``seq_lens`` shifted past its group's prefix (not shifted outside groups)."""

    groups: list[_CascadeGroup]
    suffix: _KernelPlan


@dataclass(slots=True)
class _AttentionPlan:
    block_size: int
    num_queries_per_kv: int
    cascade: _CascadePlan | None  # when set, it covers every row and the other fields are unused
    fresh_prefills: list[tuple[int, int]]  # token ranges of sequences whose whole context is this step's
    decode_kernel: _KernelPlan | None  # decode rows for the C++ kernel, or None: all rows in `groups`
    groups: list[_GroupPlan]  # rows attended with the PyTorch path
    covers_batch_in_order: bool  # one PyTorch group whose rows are exactly the batch, in order


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of a flat ragged batch for paged attention (shared by all layers).

    Attributes:
        slot_mapping: ``LongTensor[num_tokens]``: cache slot (``block_id * block_size + offset``) of each
            new token; every slot must be valid (no ``-1`` padding).
        query_start_loc: ``IntTensor[num_seqs + 1]``: prefix sums of the query lengths (``cu_seqlens_q``).
        seq_lens: ``IntTensor[num_seqs]``: context length of each sequence including this step's tokens.
        block_tables: ``IntTensor[num_seqs, max_num_blocks_per_seq]``: physical block ids, padded with 0.
        query_lens_list, seq_lens_list: host copies of the query lengths and ``seq_lens``.

    All tensors live on the model's device. The object caches an internal gather plan on first use,
    so build a new one for every step.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    plan: _AttentionPlan | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """Number of sequences that add exactly one token this step (decode rows)."""
        return sum(1 for query_len in self.query_lens_list if query_len == 1)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from host-side lists (what a model runner knows per step).

    Args:
        query_lens: new tokens per sequence this step (``>= 1``), in batch order.
        seq_lens: context length per sequence including the new tokens (``>= query_len``).
        block_tables: physical block ids per sequence; must cover ``ceil(seq_len / block_size)`` blocks.
        block_size: tokens per KV block.
        device: where the tensors go.

    Raises:
        ValueError: on mismatched lengths, a query longer than its context, or a block table too short.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    slot_mapping: list[int] = []
    for seq_idx, (query_len, seq_len, block_table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if not 1 <= query_len <= seq_len:
            raise ValueError(f"sequence {seq_idx}: need 1 <= query_len ({query_len}) <= seq_len ({seq_len})")
        if len(block_table) * block_size < seq_len:
            raise ValueError(
                f"sequence {seq_idx}: {len(block_table)} blocks of {block_size} cannot hold {seq_len} tokens"
            )
        slot_mapping.extend(
            block_table[pos // block_size] * block_size + pos % block_size
            for pos in range(seq_len - query_len, seq_len)
        )
    max_num_blocks = max((len(table) for table in block_tables), default=0)
    padded_tables = [list(table) + [0] * (max_num_blocks - len(table)) for table in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(list(accumulate(query_lens, initial=0)), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device).view(
            len(block_tables), max_num_blocks
        ),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
    )


def _build_group(
    metadata: AttentionMetadata,
    seq_ids: list[int],
    cu_query_lens: list[int],
    block_size: int,
    num_queries_per_kv: int,
    dtype: torch.dtype,
) -> _GroupPlan:
    device = metadata.block_tables.device
    query_lens = [metadata.query_lens_list[i] for i in seq_ids]
    seq_lens = [metadata.seq_lens_list[i] for i in seq_ids]
    max_query_len = max(query_lens)
    num_blocks = -(-max(seq_lens) // block_size)

    query_idx_rows, valid_rows, token_idx = [], [], []
    for row, (seq_idx, query_len) in enumerate(zip(seq_ids, query_lens)):
        start = cu_query_lens[seq_idx]
        tokens = list(range(start, start + query_len))
        token_idx.extend(tokens)
        valid_rows.extend(range(row * max_query_len, row * max_query_len + query_len))
        query_idx_rows.append(tokens + [start] * (max_query_len - query_len))

    seq_ids_t = torch.tensor(seq_ids, dtype=torch.long, device=device)
    flat_block_ids = metadata.block_tables.index_select(0, seq_ids_t)[:, :num_blocks].reshape(-1).long()

    # Query row i of a sequence sits at position seq_len - query_len + i and sees keys up to it.
    # Padding rows (i >= query_len) see the whole context: never an all-masked row (which gives NaN).
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long, device=device)[:, None, None]
    query_lens_t = torch.tensor(query_lens, dtype=torch.long, device=device)[:, None, None]
    query_pos = torch.arange(max_query_len, device=device)[None, :, None] + seq_lens_t - query_lens_t
    key_pos = torch.arange(num_blocks * block_size, device=device)[None, None, :]
    visible = (key_pos <= query_pos) & (key_pos < seq_lens_t)  # [G, max_query_len, L]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    mask = mask[:, None].expand(-1, num_queries_per_kv, -1, -1).reshape(len(seq_ids), 1, -1, visible.shape[-1])

    return _GroupPlan(
        query_idx=torch.tensor(query_idx_rows, dtype=torch.long, device=device),
        valid_rows=(
            None
            if len(valid_rows) == len(seq_ids) * max_query_len
            else torch.tensor(valid_rows, dtype=torch.long, device=device)
        ),
        token_idx=torch.tensor(token_idx, dtype=torch.long, device=device),
        flat_block_ids=flat_block_ids,
        mask=mask,
        max_query_len=max_query_len,
        num_blocks=num_blocks,
    )


def _build_kernel_plan(metadata: AttentionMetadata, decode_ids: list[int], cu_query_lens: list[int]) -> _KernelPlan:
    if len(decode_ids) == metadata.num_seqs:
        return _KernelPlan(
            token_idx=None,
            query_start_loc=metadata.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=metadata.seq_lens.to(torch.int32).contiguous(),
            block_tables=metadata.block_tables.to(torch.int32).contiguous(),
        )
    device = metadata.block_tables.device
    seq_ids = torch.tensor(decode_ids, dtype=torch.long, device=device)
    return _KernelPlan(
        token_idx=torch.tensor([cu_query_lens[i] for i in decode_ids], dtype=torch.long, device=device),
        query_start_loc=torch.arange(len(decode_ids) + 1, dtype=torch.int32, device=device),
        seq_lens=metadata.seq_lens.index_select(0, seq_ids).to(torch.int32),
        block_tables=metadata.block_tables.index_select(0, seq_ids).to(torch.int32).contiguous(),
    )


def _build_cascade_plan(metadata: AttentionMetadata, block_size: int) -> _CascadePlan | None:
    if metadata.num_seqs < cascade_attention.MIN_SEQS:
        return None
    num_computed = [s - q for s, q in zip(metadata.seq_lens_list, metadata.query_lens_list)]
    tables = metadata.block_tables.to(torch.int32)
    groups = cascade_attention.shared_prefix_groups(tables, num_computed, block_size)
    if not groups:
        return None
    device = tables.device
    shift = [0] * metadata.num_seqs  # blocks each sequence's table moves left
    cu_query_lens = list(accumulate(metadata.query_lens_list, initial=0))
    cascade_groups = []
    for seq_ids, num_blocks in groups:
        for i in seq_ids:
            shift[i] = num_blocks
        whole_batch = len(seq_ids) == metadata.num_seqs
        token_idx = [t for i in seq_ids for t in range(cu_query_lens[i], cu_query_lens[i + 1])]
        cascade_groups.append(
            _CascadeGroup(
                prefix_block_ids=tables[seq_ids[0], :num_blocks].long(),
                token_idx=None if whole_batch else torch.tensor(token_idx, dtype=torch.long, device=device),
            )
        )
    shift_t = torch.tensor(shift, dtype=torch.long, device=device)
    width = tables.shape[1]
    columns = (torch.arange(width, device=device)[None, :] + shift_t[:, None]).clamp_(max=width - 1)
    return _CascadePlan(
        groups=cascade_groups,
        suffix=_KernelPlan(
            token_idx=None,
            query_start_loc=metadata.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=(metadata.seq_lens - shift_t * block_size).to(torch.int32),
            block_tables=tables.gather(1, columns).contiguous(),
        ),
    )


def _build_plan(
    metadata: AttentionMetadata, block_size: int, num_queries_per_kv: int, dtype: torch.dtype, use_kernel: bool
) -> _AttentionPlan:
    cascade = _build_cascade_plan(metadata, block_size) if use_kernel else None
    if cascade is not None:
        return _AttentionPlan(
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            cascade=cascade,
            fresh_prefills=[],
            decode_kernel=None,
            groups=[],
            covers_batch_in_order=False,
        )
    cu_query_lens = list(accumulate(metadata.query_lens_list, initial=0))
    query_lens, seq_lens = metadata.query_lens_list, metadata.seq_lens_list
    decode_ids = [i for i, query_len in enumerate(query_lens) if query_len == 1]
    fresh_ids = [i for i, query_len in enumerate(query_lens) if 1 < query_len == seq_lens[i]]
    other_ids = [i for i, query_len in enumerate(query_lens) if 1 < query_len < seq_lens[i]]
    decode_kernel = _build_kernel_plan(metadata, decode_ids, cu_query_lens) if use_kernel and decode_ids else None
    groups = [
        _build_group(metadata, seq_ids, cu_query_lens, block_size, num_queries_per_kv, dtype)
        for seq_ids in ([] if decode_kernel else decode_ids, other_ids)
        if seq_ids
    ]
    # Decode rows are already in batch order; a lone "other" group is too (sequence by sequence).
    return _AttentionPlan(
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        cascade=None,
        fresh_prefills=[(cu_query_lens[i], cu_query_lens[i + 1]) for i in fresh_ids],
        decode_kernel=decode_kernel,
        groups=groups,
        covers_batch_in_order=decode_kernel is None and not fresh_ids and len(groups) == 1,
    )


def _use_cpu_kernel(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and cpu_kernels_available()
    )


def _attend_group(
    query: torch.Tensor, kv_cache: torch.Tensor, group: _GroupPlan, block_size: int, scale: float
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

    kv = kv_cache.index_select(1, group.flat_block_ids).view(2, num_seqs, context_len, num_kv_heads, head_size)
    out = F.scaled_dot_product_attention(
        q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=group.mask, scale=scale
    )
    out = out.view(num_seqs, num_kv_heads, num_queries_per_kv, max_query_len, head_size)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs * max_query_len, num_heads, head_size)
    if group.valid_rows is not None:
        out = out.index_select(0, group.valid_rows)
    return out


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence whose context is exactly its new tokens: straight from this step's
    K/V, no cache read, no mask tensor (the causal flash kernel skips the masked half)."""
    num_queries_per_kv = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)
    k = key.transpose(0, 1).repeat_interleave(num_queries_per_kv, dim=0)
    v = value.transpose(0, 1).repeat_interleave(num_queries_per_kv, dim=0)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def _attend_cascade(query: torch.Tensor, kv_cache: torch.Tensor, cascade: _CascadePlan, scale: float) -> torch.Tensor:
    suffix = cascade.suffix
    suffix_lse = torch.empty(query.shape[:2], dtype=torch.float32)
    out = paged_attention_cpu(
        query, kv_cache, suffix.query_start_loc, suffix.seq_lens, suffix.block_tables, scale, lse_out=suffix_lse
    )
    for group in cascade.groups:
        rows = group.token_idx
        if rows is None:
            prefix_out, prefix_lse = cascade_attention.prefix_attention(query, kv_cache, group.prefix_block_ids, scale)
            return cascade_attention.merge_attention_states(out, suffix_lse, prefix_out, prefix_lse)
        prefix_out, prefix_lse = cascade_attention.prefix_attention(
            query.index_select(0, rows), kv_cache, group.prefix_block_ids, scale
        )
        merged = cascade_attention.merge_attention_states(
            out.index_select(0, rows), suffix_lse.index_select(0, rows), prefix_out, prefix_lse
        )
        out.index_copy_(0, rows, merged)
    return out


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V at their slots in one indexed copy each (vectorised ``reshape_and_cache``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, contiguous; mutated.
        slot_mapping: ``LongTensor[num_tokens]`` of distinct valid slots.
    """
    flat_cache = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat_cache[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend every query over its sequence's context.

    Causal: query row ``i`` of a sequence with ``query_len`` new tokens and ``seq_len`` context tokens
    sits at position ``seq_len - query_len + i`` and sees positions ``0 ..`` that one. Grouped-query
    attention when ``num_heads`` is a multiple of ``num_kv_heads`` (query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``, as Hugging Face's ``repeat_kv``).

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``; mutated (new K/V stored).
            Slots never written must hold finite numbers (allocate with ``torch.zeros``): whole blocks are
            gathered and masked, and ``0 * NaN`` would poison a row.
        attn_metadata: the step's :class:`AttentionMetadata` (its gather plan is cached on first use).
        scale: multiplier of ``q . k``, usually ``head_size ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    write_to_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
    block_size = kv_cache.shape[2]
    num_queries_per_kv = query.shape[1] // kv_cache.shape[3]
    plan = attn_metadata.plan
    if plan is None or plan.block_size != block_size or plan.num_queries_per_kv != num_queries_per_kv:
        use_kernel = _use_cpu_kernel(query, kv_cache)
        plan = _build_plan(attn_metadata, block_size, num_queries_per_kv, query.dtype, use_kernel)
        attn_metadata.plan = plan
    if plan.cascade is not None:
        return _attend_cascade(query, kv_cache, plan.cascade, scale)
    if plan.covers_batch_in_order:
        return _attend_group(query, kv_cache, plan.groups[0], block_size, scale)
    kernel = plan.decode_kernel
    if kernel is not None and kernel.token_idx is None:
        return paged_attention_cpu(
            query, kv_cache, kernel.query_start_loc, kernel.seq_lens, kernel.block_tables, scale
        )
    output = torch.empty_like(query)
    for start, end in plan.fresh_prefills:
        output[start:end] = _attend_fresh(query[start:end], key[start:end], value[start:end], scale)
    if kernel is not None:
        decode_out = paged_attention_cpu(
            query.index_select(0, kernel.token_idx),
            kv_cache,
            kernel.query_start_loc,
            kernel.seq_lens,
            kernel.block_tables,
            scale,
        )
        output.index_copy_(0, kernel.token_idx, decode_out)
    for group in plan.groups:
        output.index_copy_(0, group.token_idx, _attend_group(query, kv_cache, group, block_size, scale))
    return output

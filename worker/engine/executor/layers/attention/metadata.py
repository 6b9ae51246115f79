"""Per-step attention metadata for a flat ragged batch, built once per step and shared by every layer.

The batch is vLLM's: all scheduled tokens of all sequences in one flat ``[num_tokens, ...]`` tensor,
sequence by sequence, no padding. Each sequence's new (query) tokens are the last ``query_len``
positions of its context; K/V of the whole context live in a paged cache read through the
sequence's block table (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"). :func:`build_attention_metadata` is the one place that turns the
scheduler's host-side lists into positions, the slot mapping, the device tensors and the
execution plan (:mod:`.plan`); the model runner and the tests both call it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu_extension import cpu_kernels_available
from worker.engine.executor.layers.attention.plan import AttentionPlan, build_attention_plan
from worker.engine.executor.layers.attention.tree import tree_depths, tree_mask_bits


def cpu_kernels_apply(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether decode and cascade rows go to the C++ CPU kernels: float32 or bfloat16 on CPU with the kernels
    built (a bfloat16 query and cache are widened to float32 inside the kernel).

    Decided once per engine (the model runner) and passed to every :func:`build_attention_metadata`.
    """
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels_available()


def triton_kernels_apply(device: torch.device | str) -> bool:
    """Whether every row goes to the Triton kernels (:mod:`kernels.triton_attention`): on CUDA with triton
    installed. The CPU keeps its own paths (the Triton interpreter is for tests only).

    Decided once per engine (the model runner) and passed to every :func:`build_attention_metadata`.
    """
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of a flat ragged batch for paged attention (shared by all layers).

    Attributes:
        positions: ``LongTensor[num_tokens]``: position of each new token in its sequence (RoPE uses it).
        slot_mapping: ``LongTensor[num_tokens]``: cache slot (``block_id * block_size + offset``) of each
            new token; every slot is valid (no ``-1`` padding).
        query_start_loc: ``IntTensor[num_seqs + 1]``: prefix sums of the query lengths (``cu_seqlens_q``).
        seq_lens: ``IntTensor[num_seqs]``: context length of each sequence including this step's tokens.
        block_tables: ``IntTensor[num_seqs, max_num_blocks_per_seq]``: physical block ids, padded with 0.
        query_lens_list, seq_lens_list: host copies of the query lengths and ``seq_lens``.
        plan: which rows take which execution path, with its index tensors (:mod:`.plan`).
        sliding_window: the window of the model's sliding-window layers, or None when it has none.
        sliding_plan: the plan those layers use: ``plan`` itself when no context is longer than the window,
            else one built with the window (:mod:`.plan`); None without ``sliding_window``.
        tree_mask: ``LongTensor[num_tokens]``, the token-tree mask of sequences verifying a draft tree (:mod:`.tree`;
            0 for every causal row), or None when no sequence has a tree (every path then runs unchanged).

    All tensors live on the model's device.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    plan: AttentionPlan
    sliding_window: int | None = None
    sliding_plan: AttentionPlan | None = None
    tree_mask: torch.Tensor | None = None

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
    *,
    num_queries_per_kv: int,
    dtype: torch.dtype = torch.float32,
    use_cpu_kernels: bool | None = None,
    use_triton_kernels: bool | None = None,
    batch_invariant: Sequence[bool] | None = None,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    tree_parents: Sequence[Sequence[int] | None] | None = None,
) -> AttentionMetadata:
    """Build one step's :class:`AttentionMetadata` from host-side lists (what the scheduler hands out).

    Args:
        query_lens: new tokens per sequence this step (``>= 1``), in batch order.
        seq_lens: context length per sequence including the new tokens (``>= query_len``).
        block_tables: physical block ids per sequence; must cover ``ceil(seq_len / block_size)`` blocks.
        block_size: tokens per KV block.
        num_queries_per_kv: query heads per KV head (``num_heads // num_kv_heads``; 1 without GQA).
        dtype: the query dtype (the attention masks are built in it).
        use_cpu_kernels: route decode and cascade rows to the C++ CPU kernels; None decides with
            :func:`cpu_kernels_apply` for ``device`` and ``dtype``.
        use_triton_kernels: route every row to the Triton kernels; None decides with
            :func:`triton_kernels_apply` for ``device``.
        batch_invariant: per sequence, whether its rows take the batch-invariant path (see :mod:`.plan`);
            ``None``: no sequence.
        device: where the tensors go.
        sliding_window: the window of the model's sliding-window layers (``>= 1``), None when it has none.
        tree_parents: per sequence, None or the ``parent_idx`` of the draft tree it verifies (:mod:`.tree`):
            its query is its last token then the ``len(parent_idx)`` nodes, each node's position is the last
            token's plus its depth, and its rows attend through the tree mask. None: no trees.

    Raises:
        ValueError: on mismatched lengths, a query longer than its context, a block table too short, a
            window below 1, a tree whose query is not ``1 + num_nodes`` rows or not in topological order, or a
            tree beside a sliding window.
    """
    num_seqs = len(query_lens)
    if not num_seqs == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({num_seqs}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    query_lens_np = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs)
    table_lens = np.fromiter((len(table) for table in block_tables), dtype=np.int64, count=num_seqs)
    bad_query = np.flatnonzero((query_lens_np < 1) | (query_lens_np > seq_lens_np))
    if bad_query.size:
        i = int(bad_query[0])
        raise ValueError(f"sequence {i}: need 1 <= query_len ({query_lens_np[i]}) <= seq_len ({seq_lens_np[i]})")
    short_table = np.flatnonzero(table_lens * block_size < seq_lens_np)
    if short_table.size:
        i = int(short_table[0])
        raise ValueError(f"sequence {i}: {table_lens[i]} blocks of {block_size} cannot hold {seq_lens_np[i]} tokens")

    tables = np.zeros((num_seqs, int(table_lens.max(initial=0))), dtype=np.int32)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = table
    cu_query_lens = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens_np, out=cu_query_lens[1:])
    num_tokens = int(cu_query_lens[-1])
    num_computed = seq_lens_np - query_lens_np
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_query_lens[:-1] - num_computed, query_lens_np)
    token_seq_idx = np.repeat(np.arange(num_seqs), query_lens_np)
    slot_mapping = tables[token_seq_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    tree_mask_np = None
    if tree_parents is not None and any(parents is not None for parents in tree_parents):
        if sliding_window is not None:
            raise ValueError("draft trees cannot be verified with sliding-window layers")
        tree_mask_np = np.zeros(num_tokens, dtype=np.int64)
        for i, parents in enumerate(tree_parents):
            if parents is None:
                continue
            if query_lens_np[i] != 1 + len(parents):
                raise ValueError(f"sequence {i}: a tree of {len(parents)} nodes needs a query of {1 + len(parents)}")
            first = int(cu_query_lens[i])
            tree_mask_np[first : first + 1 + len(parents)] = tree_mask_bits(list(parents))
            # Slots stay consecutive; rotary positions follow depth (siblings share a position).
            positions[first + 1 : first + 1 + len(parents)] = positions[first] + np.asarray(tree_depths(list(parents)))

    if use_cpu_kernels is None:
        use_cpu_kernels = cpu_kernels_apply(device, dtype)
    if use_triton_kernels is None:
        use_triton_kernels = triton_kernels_apply(device)
    query_lens_list = query_lens_np.tolist()
    seq_lens_list = seq_lens_np.tolist()
    block_tables_t = torch.from_numpy(tables).to(device)
    query_start_loc = torch.from_numpy(cu_query_lens.astype(np.int32)).to(device)
    seq_lens_t = torch.from_numpy(seq_lens_np.astype(np.int32)).to(device)

    tree_mask = None if tree_mask_np is None else torch.from_numpy(tree_mask_np).to(device)

    def plan(window: int | None) -> AttentionPlan:
        return build_attention_plan(
            query_lens_list,
            seq_lens_list,
            query_start_loc,
            seq_lens_t,
            block_tables_t,
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            dtype=dtype,
            use_cpu_kernels=use_cpu_kernels,
            use_triton_kernels=use_triton_kernels,
            batch_invariant=batch_invariant,
            sliding_window=window,
            tree_mask=tree_mask,
        )

    full_plan = plan(None)
    sliding_plan = None
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        sliding_plan = full_plan if int(seq_lens_np.max(initial=0)) <= sliding_window else plan(sliding_window)
    return AttentionMetadata(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables_t,
        query_lens_list=query_lens_list,
        seq_lens_list=seq_lens_list,
        plan=full_plan,
        sliding_window=sliding_window,
        sliding_plan=sliding_plan,
        tree_mask=tree_mask,
    )

"""The execution plan of one step's attention: which rows take which path, with their index tensors.

Paths (executed by :mod:`.paged`):

- on CUDA with Triton installed (:func:`~.metadata.triton_kernels_apply`), every row goes to one Triton
  kernel (:func:`kernels.triton_attention.paged_attention_triton`) that reads K/V through the block table in
  place; the paths below are the CPU's:
- a sequence whose whole context is this step's tokens (a fresh prompt, not chunked, nothing cached) of more
  than one token attends its own K/V straight from the step (no cache read, no gather, no mask): when the
  kernels apply, every such prompt of a run of consecutive ones in one call of the C++ causal kernel
  (:func:`kernels.cpu_attention.causal_attention_cpu`, register tiles over each KV head's query heads); without
  them, one causal ``scaled_dot_product_attention`` call per prompt;
- decode rows (``query_len == 1``) and other queries of up to ``MAX_KERNEL_QUERY_LEN`` tokens (the verification of
  speculative drafts, prefill chunks of a few hundred tokens over a cached prefix or an earlier chunk) go to the
  C++ paged kernel, which reads K/V from the blocks in place, when the kernels apply (float32 or bfloat16 on CPU,
  :func:`~.metadata.cpu_kernels_apply`); the kernel computes each row alone, so a verified draft gets the
  very bits a plain decode step would give it;
- the rest (longer prefill chunks over a cached prefix or an earlier chunk; without the kernels, decode
  rows and short extends too) are split into two groups, decode rows and the others; for each group, one ``index_select``
  gathers the whole blocks of every sequence into a padded
  ``[num_group_seqs, num_blocks * block_size, num_kv_heads, head_size]`` tensor and one
  ``scaled_dot_product_attention`` call runs over it with an additive mask (causal and length).
  Grouped-query attention folds the ``num_heads // num_kv_heads`` query heads that share a KV head
  into the query-length axis, so K/V are never repeated;
- when at least ``MIN_SEQS`` sequences share their first ``MIN_SHARED_TOKENS``-plus tokens' blocks (a
  prefix-cached preamble) and the kernels apply, every row goes through cascade attention instead
  (:mod:`.cascade`): each shared prefix once for its group, every sequence's own remaining context
  through the kernel;
- a *batch-invariant* sequence (a seeded request, see the model runner) sends every row, whatever its
  query length, to the C++ kernel over its whole context and never joins a cascade group: the kernel
  computes each token alone in a fixed order, so the sequence's numbers are the same bits whether its
  context was computed in one pass, in chunks or after a recompute, and whatever shares the step
  (docs/engine.md, "Batch-invariant numerics"). Without the kernels (not float32, or not built) the
  sequence takes the ordinary paths.

A sequence verifying a draft tree (:mod:`.tree`, at most 64 rows) takes the same paths as a chain's
verification: the kernels apply the step's ``tree_mask`` to its rows, and the group mask hides the query rows
that are not a row's ancestors. A step without trees builds exactly what it did before.

The index tensors and masks depend only on the batch, so they are built once per step, by
:func:`~.metadata.build_attention_metadata`, and reused by every layer.

Sliding-window layers (Mistral, Gemma 2/3 local layers, Qwen2 with ``use_sliding_window``) get a plan of
their own, built with ``sliding_window`` only in steps where some context is longer than the window (in the
others the full plan serves them unchanged): the kernels read only each token's last ``sliding_window``
positions, the group masks also hide the positions before the window, and a fresh prompt longer than the
window goes to the masked group path. Such a plan has no cascade: cascade attention reads a shared prefix
for every query, but past the window a query sees only part of it (or none), so those layers attend their
window through the kernel instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from worker.engine.executor.layers.attention import cascade as cascade_attention

# Queries up to this many tokens take the C++ kernel, like decode rows: a speculative verification (k + 1
# positions) costs about k + 1 decode rows there, against a gather of the whole context for the masked group,
# and a prompt of a few hundred tokens costs less than the causal SDPA call (docs/engine.md, "Attention metadata and plan").
MAX_KERNEL_QUERY_LEN = 512


@dataclass(slots=True)
class _Batch:
    """The step's batch as the builders read it (see ``AttentionMetadata`` for each field)."""

    query_lens_list: list[int]
    seq_lens_list: list[int]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


@dataclass(slots=True)
class GroupPlan:
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
class KernelPlan:
    """Rows for the C++ CPU kernel: decode rows and every row of batch-invariant sequences.

    ``token_idx``: ``[num_kernel_tokens]`` flat batch index of each of those rows, sequence by sequence
    (``None`` when they are the whole batch, in order); ``query_start_loc`` (``[num_kernel_seqs + 1]``),
    ``seq_lens`` and ``block_tables``: int32 metadata of those sequences only; ``tree_mask``: int64 of those rows
    (:mod:`.tree`), None when the step has no tree.
    """

    token_idx: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    tree_mask: torch.Tensor | None = None


@dataclass(slots=True)
class CascadeGroup:
    """Rows of the sequences behind one shared prefix: ``prefix_block_ids`` (``LongTensor[num_shared_blocks]``)
    and ``token_idx`` (``LongTensor[num_group_tokens]``, ``None`` when the group is the whole batch)."""

    prefix_block_ids: torch.Tensor
    token_idx: torch.Tensor | None


@dataclass(slots=True)
class CascadePlan:
    """``groups`` attend their shared prefix once each; ``suffix``: all rows for the C++ kernel, each
    sequence's block table and ``seq_lens`` shifted past its group's prefix (not shifted outside groups)."""

    groups: list[CascadeGroup]
    suffix: KernelPlan


@dataclass(slots=True)
class TritonPlan:
    """The whole batch in one Triton kernel launch (CUDA): its grid needs the longest query, and its choice of
    split-KV the longest context."""

    max_query_len: int
    max_seq_len: int


@dataclass(slots=True)
class FreshRun:
    """Consecutive fresh prompts: tokens ``start:end`` of the batch; ``cu_seqlens``: int32 ``[num_run_seqs + 1]``
    prefix sums of their lengths from 0; ``seq_lens`` (int32) and ``block_tables`` (int32, contiguous): their rows
    of the step's, for the paged kernel (a quantized cache's fresh prompts, :mod:`.paged`)."""

    start: int
    end: int
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(slots=True)
class AttentionPlan:
    """Which rows of a step take which attention path; built once per step, read by every layer."""

    block_size: int
    num_queries_per_kv: int
    cascade: CascadePlan | None  # when set, it covers every row and the other fields are unused
    fresh_prefills: list[tuple[int, int]]  # token ranges of sequences whose whole context is this step's
    kernel: KernelPlan | None  # decode and batch-invariant rows for the C++ kernel, or None
    groups: list[GroupPlan]  # rows attended with the PyTorch path
    covers_batch_in_order: bool  # one PyTorch group whose rows are exactly the batch, in order
    triton: TritonPlan | None = None  # when set, it covers every row and the other fields are unused
    sliding_window: int | None = None  # keys each query sees (kernels and masks apply it), None: all
    # With the kernels: runs of consecutive fresh prompts, one C++ causal kernel call each; empty without the
    # kernels (fresh_prefills then go to SDPA).
    fresh_runs: list[FreshRun] = field(default_factory=list)


def _build_group(
    batch: _Batch,
    seq_ids: list[int],
    cu_query_lens: list[int],
    block_size: int,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    tree_mask: torch.Tensor | None,
) -> GroupPlan:
    device = batch.block_tables.device
    query_lens = [batch.query_lens_list[i] for i in seq_ids]
    seq_lens = [batch.seq_lens_list[i] for i in seq_ids]
    max_query_len = max(query_lens)
    num_blocks = -(-max(seq_lens) // block_size)

    query_idx_rows: list[list[int]] = []
    valid_rows: list[int] = []
    token_idx: list[int] = []
    for row, (seq_idx, query_len) in enumerate(zip(seq_ids, query_lens)):
        start = cu_query_lens[seq_idx]
        tokens = list(range(start, start + query_len))
        token_idx.extend(tokens)
        valid_rows.extend(range(row * max_query_len, row * max_query_len + query_len))
        query_idx_rows.append(tokens + [start] * (max_query_len - query_len))

    seq_ids_t = torch.tensor(seq_ids, dtype=torch.long, device=device)
    flat_block_ids = batch.block_tables.index_select(0, seq_ids_t)[:, :num_blocks].reshape(-1).long()

    # Query row i of a sequence sits at position seq_len - query_len + i and sees keys up to it.
    # Padding rows (i >= query_len) see the whole context: never an all-masked row (which gives NaN).
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long, device=device)[:, None, None]
    query_lens_t = torch.tensor(query_lens, dtype=torch.long, device=device)[:, None, None]
    query_pos = torch.arange(max_query_len, device=device)[None, :, None] + seq_lens_t - query_lens_t
    key_pos = torch.arange(num_blocks * block_size, device=device)[None, None, :]
    visible = (key_pos <= query_pos) & (key_pos < seq_lens_t)  # [G, max_query_len, L]
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    query_idx = torch.tensor(query_idx_rows, dtype=torch.long, device=device)
    if tree_mask is not None:
        # A tree row sees the query rows whose bit is set (padding rows repeat row 0, which sees itself only).
        bits = tree_mask[query_idx][:, :, None]  # [G, max_query_len, 1]
        query_row = (key_pos - (seq_lens_t - query_lens_t)).clamp(0, 63)
        in_query = key_pos >= seq_lens_t - query_lens_t
        visible &= (bits == 0) | ~in_query | (((bits >> query_row) & 1) == 1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    mask = mask[:, None].expand(-1, num_queries_per_kv, -1, -1).reshape(len(seq_ids), 1, -1, visible.shape[-1])

    return GroupPlan(
        query_idx=query_idx,
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


def _build_kernel_plan(
    batch: _Batch, kernel_ids: list[int], cu_query_lens: list[int], tree_mask: torch.Tensor | None
) -> KernelPlan:
    if len(kernel_ids) == batch.num_seqs:
        return KernelPlan(
            token_idx=None,
            query_start_loc=batch.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=batch.seq_lens.to(torch.int32).contiguous(),
            block_tables=batch.block_tables.to(torch.int32).contiguous(),
            tree_mask=tree_mask,
        )
    device = batch.block_tables.device
    seq_ids = torch.tensor(kernel_ids, dtype=torch.long, device=device)
    token_idx = [t for i in kernel_ids for t in range(cu_query_lens[i], cu_query_lens[i + 1])]
    query_start_loc = list(accumulate((batch.query_lens_list[i] for i in kernel_ids), initial=0))
    token_idx_t = torch.tensor(token_idx, dtype=torch.long, device=device)
    return KernelPlan(
        token_idx=token_idx_t,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=batch.seq_lens.index_select(0, seq_ids).to(torch.int32),
        block_tables=batch.block_tables.index_select(0, seq_ids).to(torch.int32).contiguous(),
        tree_mask=None if tree_mask is None else tree_mask.index_select(0, token_idx_t),
    )


def _fresh_runs(batch: _Batch, fresh_ids: list[int], cu_query_lens: list[int]) -> list[FreshRun]:
    """Consecutive fresh prompts as runs, one causal kernel call each (a step's prompts usually follow each other:
    one run)."""
    runs: list[list[int]] = []
    for i in fresh_ids:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    device = batch.block_tables.device
    return [
        FreshRun(
            start=cu_query_lens[ids[0]],
            end=cu_query_lens[ids[-1] + 1],
            cu_seqlens=torch.tensor(
                [cu_query_lens[i] - cu_query_lens[ids[0]] for i in [*ids, ids[-1] + 1]],
                dtype=torch.int32,
                device=device,
            ),
            seq_lens=batch.seq_lens[ids[0] : ids[-1] + 1].to(torch.int32).contiguous(),
            block_tables=batch.block_tables[ids[0] : ids[-1] + 1].to(torch.int32).contiguous(),
        )
        for ids in runs
    ]


def _build_cascade_plan(
    batch: _Batch, block_size: int, batch_invariant: list[bool], tree_mask: torch.Tensor | None
) -> CascadePlan | None:
    if batch.num_seqs < cascade_attention.MIN_SEQS:
        return None
    # A batch-invariant sequence counts as having no cached prefix: it never joins a group.
    num_computed = [
        0 if invariant else s - q
        for s, q, invariant in zip(batch.seq_lens_list, batch.query_lens_list, batch_invariant)
    ]
    tables = batch.block_tables.to(torch.int32)
    groups = cascade_attention.shared_prefix_groups(tables, num_computed, block_size)
    if not groups:
        return None
    device = tables.device
    shift = [0] * batch.num_seqs  # blocks each sequence's table moves left
    cu_query_lens = list(accumulate(batch.query_lens_list, initial=0))
    cascade_groups = []
    for seq_ids, num_blocks in groups:
        for i in seq_ids:
            shift[i] = num_blocks
        whole_batch = len(seq_ids) == batch.num_seqs
        token_idx = [t for i in seq_ids for t in range(cu_query_lens[i], cu_query_lens[i + 1])]
        cascade_groups.append(
            CascadeGroup(
                prefix_block_ids=tables[seq_ids[0], :num_blocks].long(),
                token_idx=None if whole_batch else torch.tensor(token_idx, dtype=torch.long, device=device),
            )
        )
    shift_t = torch.tensor(shift, dtype=torch.long, device=device)
    width = tables.shape[1]
    columns = (torch.arange(width, device=device)[None, :] + shift_t[:, None]).clamp_(max=width - 1)
    return CascadePlan(
        groups=cascade_groups,
        suffix=KernelPlan(
            token_idx=None,
            query_start_loc=batch.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=(batch.seq_lens - shift_t * block_size).to(torch.int32),
            block_tables=tables.gather(1, columns).contiguous(),
            tree_mask=tree_mask,
        ),
    )


def build_attention_plan(
    query_lens_list: list[int],
    seq_lens_list: list[int],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    block_size: int,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    use_cpu_kernels: bool,
    use_triton_kernels: bool = False,
    batch_invariant: Sequence[bool] | None = None,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """Split a step's sequences among the execution paths and build their index tensors and masks.

    Args:
        query_lens_list, seq_lens_list: new tokens and context length per sequence (host lists).
        query_start_loc: ``IntTensor[num_seqs + 1]``; seq_lens: ``IntTensor[num_seqs]``;
            block_tables: ``IntTensor[num_seqs, max_num_blocks]`` (as in ``AttentionMetadata``).
        block_size: tokens per KV block; num_queries_per_kv: query heads per KV head.
        dtype: the query dtype (masks are additive in it).
        use_cpu_kernels: send decode rows, or every row when a long prefix is shared, to the C++ kernels.
        use_triton_kernels: send every row to the Triton kernel (CUDA); no index tensors or masks are built.
        batch_invariant: per sequence, whether all its rows go to the C++ kernel (see the module
            docstring); ``None``: no sequence. Ignored without ``use_cpu_kernels``.
        sliding_window: the plan of sliding-window layers: each query sees its last ``sliding_window``
            positions; no cascade (module docstring).
        tree_mask: ``LongTensor[num_tokens]``, the step's token-tree mask (:mod:`.tree`), or None without trees.
    """
    if use_triton_kernels:
        return AttentionPlan(
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            cascade=None,
            fresh_prefills=[],
            kernel=None,
            groups=[],
            covers_batch_in_order=False,
            triton=TritonPlan(max_query_len=max(query_lens_list, default=0), max_seq_len=max(seq_lens_list, default=0)),
            sliding_window=sliding_window,
        )
    batch = _Batch(query_lens_list, seq_lens_list, query_start_loc, seq_lens, block_tables)
    use_kernel = use_cpu_kernels
    invariant = list(batch_invariant) if use_kernel and batch_invariant is not None else [False] * batch.num_seqs
    cascade = (
        _build_cascade_plan(batch, block_size, invariant, tree_mask) if use_kernel and sliding_window is None else None
    )
    if cascade is not None:
        return AttentionPlan(
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            cascade=cascade,
            fresh_prefills=[],
            kernel=None,
            groups=[],
            covers_batch_in_order=False,
        )
    cu_query_lens = list(accumulate(batch.query_lens_list, initial=0))
    decode_ids = [i for i, query_len in enumerate(query_lens_list) if query_len == 1]
    # A fresh prompt longer than the window needs the window's mask: it joins the masked group.
    fresh_limit = math.inf if sliding_window is None else sliding_window
    short = MAX_KERNEL_QUERY_LEN if use_kernel else 1  # longest query the kernel (or the decode group) takes
    kernel_ids = [i for i, query_len in enumerate(query_lens_list) if query_len <= short or invariant[i]]
    # With the kernels a fresh prompt of any length goes to the causal kernel; without them, SDPA takes those
    # longer than one token.
    fresh_ids = [
        i for i, q in enumerate(query_lens_list) if 1 < q == seq_lens_list[i] <= fresh_limit and not invariant[i]
    ]
    fresh_set = set(fresh_ids)
    kernel_ids = [i for i in kernel_ids if i not in fresh_set]
    other_ids = [
        i
        for i, q in enumerate(query_lens_list)
        if q > short and not q == seq_lens_list[i] <= fresh_limit and not invariant[i]
    ]
    kernel = _build_kernel_plan(batch, kernel_ids, cu_query_lens, tree_mask) if use_kernel and kernel_ids else None
    groups = [
        _build_group(batch, seq_ids, cu_query_lens, block_size, num_queries_per_kv, dtype, sliding_window, tree_mask)
        for seq_ids in ([] if kernel else decode_ids, other_ids)
        if seq_ids
    ]
    # Decode rows are already in batch order; a lone "other" group is too (sequence by sequence).
    return AttentionPlan(
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        cascade=None,
        fresh_prefills=[(cu_query_lens[i], cu_query_lens[i + 1]) for i in fresh_ids],
        fresh_runs=_fresh_runs(batch, fresh_ids, cu_query_lens) if use_kernel else [],
        kernel=kernel,
        groups=groups,
        covers_batch_in_order=kernel is None and not fresh_ids and len(groups) == 1,
        sliding_window=sliding_window,
    )

"""The KV cache manager: each sequence's block table, on-demand slot allocation, prefix-cache lookups.

vLLM V1's ``KVCacheManager`` (pure Python): a sequence's block table maps logical block ``i`` (positions
``i * block_size .. (i + 1) * block_size - 1``) to a physical :class:`~worker.engine.core.block_pool.KVCacheBlock`.
Blocks are allocated as the scheduler hands out tokens (``allocate_slots``), full computed blocks are
entered into the prefix cache after each step (``cache_blocks``), and everything goes back to the pool,
tail first, when the sequence finishes or is preempted (``free``).

Copy-on-write forks (Kwon et al. 2023, "PagedAttention", section 4.4): ``fork`` gives a child sequence
its parent's whole block table by reference count. The first time a sequence is about to write into a
block it shares (only ever a partially filled last block: full blocks are never written again),
``allocate_slots`` gives it a fresh block and records the copy ``(src, dst)``; the model runner executes
the step's recorded copies before its forward pass (``take_blocks_to_copy``). Freeing a branch drops only
its own references. With forks disabled (``enable_forks=False``, the baseline that shows what sharing
saves) ``fork`` copies every block of the parent at once instead.

A sequence with a ``cache_salt`` keys its blocks under its own root instead of the shared one, so the
prefix cache never shares its blocks with other sequences (vLLM's ``cache_salt``): the engine salts the
branches of a request when forks are disabled.

Sliding window (vLLM's ``SlidingWindowManager``): when every layer of the model attends only its last
``sliding_window`` positions (Mistral), a query at position ``p`` never reads a key at ``p - sliding_window``
or before, and later queries sit further on. So when a sequence has computed ``n`` tokens, its blocks whose
positions are all ``<= n - sliding_window`` are returned to the pool (``allocate_slots``, before it counts
what it needs); in its block table they are replaced by a pinned *null block* that is never written, so
logical block ``i`` still sits at index ``i`` and every id in a table is valid. A freed block keeps its
prefix-cache entry until the pool reuses it. Models that mix local and global layers (Gemma 2/3) pass no
window: their global layers still read every block.

Long-RoPE classes: under Phi-3's ``longrope`` scaling a sequence's K are rotated with the long factors when
it is longer than ``original_max_position_embeddings`` (``long_rope_len`` here), with the short ones
otherwise (:func:`~worker.engine.executor.models.llama.long_rope_positions`). A sequence's class is fixed
when it gets its blocks; blocks of the long class hash from a root prefix of their own
(:meth:`KVCacheManager.root_prefix_id`), so the two classes never share a cached block, and a short-class
sequence that grows past the limit must be recomputed (:meth:`KVCacheManager.needs_recompute`; the
scheduler does it), as Hugging Face's Phi-3 drops its cache at that point.

Roots: a sequence's first block hashes from one of four shared roots, by long-RoPE class and by whether
it is batch invariant (a seeded request's blocks hold the bits the batch-invariant attention path
computes, docs/engine.md, "Batch-invariant numerics"; they are shared only with other batch-invariant
sequences), or from a root of its own when salted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

from worker.engine.core.block_pool import (
    ROOT_PREFIX_ID,
    BlockHash,
    BlockId,
    BlockPool,
    KVCacheBlock,
    PrefixId,
)
from worker.engine.core.request import Sequence

# The parent of a long-RoPE sequence's first block (pool-issued prefix ids start at 1).


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's prefix-cache counters, in tokens: ``queries`` looked up at admission (re-admissions after
    preemption included), ``hits`` supplied by the cache (both 0 with caching off)."""

    queries: int = 0
    hits: int = 0


@dataclass(slots=True)
class SlotOccupancy:
    """The blocks sequences reference now: ``num_slots`` slots (``block_size`` per block), of which
    ``num_tokens_stored`` hold a computed token (the rest are the empty tails of last blocks)."""

    num_tokens_stored: int
    num_slots: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Block tables of all sequences holding KV blocks, over one :class:`BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        enable_forks: bool = True,
        sliding_window: int | None = None,
        long_rope_len: int | None = None,
    ) -> None:
        """``enable_forks=False``: :meth:`fork` copies the parent's blocks (module docstring).
        ``sliding_window``: the window of a model whose every layer is windowed (blocks before it are freed);
        it takes one block of the pool for the null block. ``long_rope_len``: sequences longer than this are
        of the long-RoPE class (module docstring).

        Raises:
            ValueError: ``num_blocks < 1``, a window below 1, or a window with fewer than 2 blocks.
        """
        if sliding_window is not None and (sliding_window < 1 or num_blocks < 2):
            raise ValueError(f"sliding_window={sliding_window} needs a window >= 1 and at least 2 blocks")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_forks = enable_forks
        self.block_pool = BlockPool(num_blocks, block_size, enable_caching)
        self.seq_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self._seqs: dict[int, Sequence] = {}
        # Tokens each block table was sized for (computed + scheduled this step).
        self._num_slots: dict[int, int] = {}
        # Prefix ids of each sequence's leading blocks that have been offered to the prefix cache.
        self._prefix_ids: dict[int, list[PrefixId]] = {}
        # Copy-on-write copies recorded since the last take_blocks_to_copy(), in order.
        self._blocks_to_copy: list[tuple[BlockId, BlockId]] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.sliding_window = sliding_window
        self.long_rope_len = long_rope_len
        self._long_rope: dict[int, bool] = {}  # class of each holder's blocks, with long_rope_len
        # Stands for freed blocks before the window in block tables; its pool reference pins it (never freed).
        self.null_block: KVCacheBlock | None = None
        if sliding_window is not None:
            self.null_block = self.block_pool.get_new_blocks(1)[0]

    def _is_long_rope(self, seq: Sequence) -> bool:
        """Whether ``seq``'s K are (a holder) or will be (otherwise) of the long-RoPE class."""
        assert self.long_rope_len is not None
        return self._long_rope.get(seq.seq_id, seq.num_tokens > self.long_rope_len)

    def _root_prefix_id(self, seq: Sequence) -> PrefixId:
        """The parent prefix of ``seq``'s first block (module docstring, "Roots"): ``0``, ``-1``, ``-2`` or
        ``-3`` by batch invariance and long-RoPE class, ``-4 - cache_salt`` when salted. Every root but ``0``
        is negative, so none equals a prefix id the pool hands out."""
        if seq.cache_salt is not None:
            return PrefixId(-4 - seq.cache_salt)
        long_rope = self.long_rope_len is not None and self._is_long_rope(seq)
        return PrefixId(ROOT_PREFIX_ID - int(seq.params.batch_invariant) - 2 * int(long_rope))

    def needs_recompute(self, seq: Sequence) -> bool:
        """A holder whose K were computed with the short RoPE factors but that is now longer than
        ``long_rope_len``: its blocks must be dropped and every token computed again (module docstring)."""
        return (
            self.long_rope_len is not None
            and seq.seq_id in self._long_rope
            and not self._long_rope[seq.seq_id]
            and seq.num_tokens > self.long_rope_len
        )

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's ``kv_cache_usage``: fraction of blocks referenced by some sequence, in [0, 1]."""
        return 1.0 - self.block_pool.get_num_free_blocks() / self.block_pool.num_blocks

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks matching ``seq``'s leading tokens, and the tokens they hold.

        At least the last token is always left to compute (its logits give the next token). Requests
        asking for prompt logprobs get no hit (their logits are needed at every prompt position).
        Pure lookup: takes no reference (``allocate_slots`` does).
        """
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return [], 0
        block_size, token_ids = self.block_size, seq.token_ids
        blocks: list[KVCacheBlock] = []
        parent = self._root_prefix_id(seq)
        for start in range(0, (seq.num_tokens - 1) // block_size * block_size, block_size):
            block = self.block_pool.get_cached_block(BlockHash((parent, tuple(token_ids[start : start + block_size]))))
            if block is None:
                break
            assert block.prefix_id is not None
            blocks.append(block)
            parent = block.prefix_id
        return blocks, len(blocks) * block_size

    def next_block_hash(self, seq: Sequence, computed_blocks: SequenceT[KVCacheBlock] = ()) -> BlockHash | None:
        """Key of the first full block of ``seq`` that is not (yet) in the prefix cache for it, or None.

        For a waiting ``seq``, ``computed_blocks`` is its :meth:`get_computed_blocks` hit chain and only a
        block that lookup could hit counts (it must end before the last token). For a sequence holding
        blocks (``computed_blocks`` empty), it is the next block :meth:`cache_blocks` will enter once
        computed; None when that block is not full of known tokens, or when caching is off.
        """
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return None
        block_size = self.block_size
        if seq.seq_id in self.seq_to_blocks:
            prefix_ids = self._prefix_ids[seq.seq_id]
            parent = prefix_ids[-1] if prefix_ids else self._root_prefix_id(seq)
            start, limit = len(prefix_ids) * block_size, seq.num_tokens
        else:
            last = computed_blocks[-1].prefix_id if computed_blocks else self._root_prefix_id(seq)
            assert last is not None
            parent, start, limit = last, len(computed_blocks) * block_size, seq.num_tokens - 1
        if start + block_size > limit:
            return None
        return BlockHash((parent, tuple(seq.token_ids[start : start + block_size])))

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup: ``num_query_tokens`` looked up, ``num_hit_tokens`` of them cached."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_query_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache counters since the last call (take and reset, as vLLM's)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: SequenceT[KVCacheBlock] = ()
    ) -> bool:
        """Make ``seq``'s block table cover ``num_new_tokens`` more tokens; all or nothing.

        The table afterwards covers ``seq.num_computed_tokens + len(new_computed_blocks) * block_size +
        num_new_tokens`` tokens. ``new_computed_blocks`` (from :meth:`get_computed_blocks`, only for a
        sequence holding no blocks) are prefix-cache hits: referenced, not recomputed; the caller then
        advances ``seq.num_computed_tokens`` past them. A block the new tokens will be written into that
        is shared with another sequence (after :meth:`fork`) is replaced by a fresh block and the copy is
        recorded for :meth:`take_blocks_to_copy` (copy-on-write).

        With a sliding window, blocks wholly before the window of the first new token go back to the pool
        first (module docstring), whatever the outcome.

        Returns:
            False, changing nothing else, when the pool lacks free blocks (the scheduler then preempts).
        """
        block_size, seq_id = self.block_size, seq.seq_id
        blocks = self.seq_to_blocks.get(seq_id)
        assert not new_computed_blocks or not blocks, "prefix hits only for a sequence without blocks"
        if blocks and self.sliding_window is not None:
            self._free_blocks_before_window(blocks, seq.num_computed_tokens)
        num_tokens = seq.num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, block_size) - (len(blocks) if blocks else 0) - len(new_computed_blocks)
        shared_idx: list[int] = []
        if blocks and num_new_tokens > 0:
            first_written = seq.num_computed_tokens // block_size
            shared_idx = [i for i in range(first_written, len(blocks)) if blocks[i].ref_cnt > 1]
        # A hit on a free cached block takes it out of the free queue, so it cannot also be a new block.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) + len(shared_idx) > self.block_pool.get_num_free_blocks() - num_free_hits:
            return False
        if blocks is None:
            blocks = self.seq_to_blocks[seq_id] = []
            self._seqs[seq_id] = seq
            self._prefix_ids[seq_id] = []
            if self.long_rope_len is not None:
                self._long_rope[seq_id] = seq.num_tokens > self.long_rope_len
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            for block in new_computed_blocks:
                assert block.prefix_id is not None  # a prefix-cache hit is a cached block
                self._prefix_ids[seq_id].append(block.prefix_id)
            if self.sliding_window is not None:
                self._free_blocks_before_window(blocks, len(new_computed_blocks) * block_size)
        if shared_idx:
            for block_idx, fresh in zip(shared_idx, self.block_pool.get_new_blocks(len(shared_idx)), strict=True):
                shared = blocks[block_idx]
                self._blocks_to_copy.append((shared.block_id, fresh.block_id))
                blocks[block_idx] = fresh
                self.block_pool.free_blocks([shared])
        if num_new_blocks > 0:
            blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self._num_slots[seq_id] = num_tokens
        return True

    def _free_blocks_before_window(self, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Return the blocks whose positions are all ``<= num_computed - sliding_window`` to the pool (the last
        first, so the earliest are evicted last), putting the null block in their place."""
        assert self.sliding_window is not None and self.null_block is not None
        null_block = self.null_block
        freed = []
        for block_idx in range((num_computed - self.sliding_window + 1) // self.block_size - 1, -1, -1):
            if blocks[block_idx] is null_block:
                break  # the ones before were freed by an earlier step
            freed.append(blocks[block_idx])
            blocks[block_idx] = null_block
        if freed:
            self.block_pool.touch([null_block] * len(freed))
            self.block_pool.free_blocks(freed)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` ``parent``'s block table by reference (one more reference to every block).

        ``child`` must hold no blocks and already equal ``parent`` over the computed tokens (same
        ``num_computed_tokens``, same leading ``token_ids``); nothing is allocated or copied now, the
        first write into a shared block copies it (:meth:`allocate_slots`). With forks disabled, ``child``
        gets fresh blocks instead and a copy of each of ``parent``'s is recorded for
        :meth:`take_blocks_to_copy`; its blocks start outside the prefix cache.

        Returns:
            False, changing nothing, when forks are disabled and the pool lacks the blocks to copy into.

        Raises:
            ValueError: ``child`` already holds blocks, ``parent`` holds none, or they differ in
                ``num_computed_tokens``.
        """
        if child.seq_id in self.seq_to_blocks:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        if parent.seq_id not in self.seq_to_blocks:
            raise ValueError(f"sequence {parent.seq_id} holds no blocks to fork")
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise ValueError("a fork must start with its parent's num_computed_tokens")
        blocks = self.seq_to_blocks[parent.seq_id]
        if self.enable_forks:
            self.block_pool.touch(blocks)
            self.seq_to_blocks[child.seq_id] = list(blocks)
            self._prefix_ids[child.seq_id] = list(self._prefix_ids[parent.seq_id])
        else:
            if len(blocks) > self.block_pool.get_num_free_blocks():
                return False
            copies = self.block_pool.get_new_blocks(len(blocks))
            self._blocks_to_copy += [(src.block_id, dst.block_id) for src, dst in zip(blocks, copies, strict=True)]
            self.seq_to_blocks[child.seq_id] = copies
            self._prefix_ids[child.seq_id] = []
        self._seqs[child.seq_id] = child
        self._num_slots[child.seq_id] = self._num_slots[parent.seq_id]
        if parent.seq_id in self._long_rope:
            self._long_rope[child.seq_id] = self._long_rope[parent.seq_id]
        return True

    def take_blocks_to_copy(self) -> list[tuple[BlockId, BlockId]]:
        """The copy-on-write copies ``(src, dst)`` recorded since the last call, in order (take and reset).

        Every ``dst`` is distinct and still referenced (copies into blocks freed meanwhile are dropped);
        all copies read the blocks as they were before this step's writes.
        """
        blocks_to_copy, self._blocks_to_copy = self._blocks_to_copy, []
        return blocks_to_copy

    def cache_blocks(self, seq: Sequence) -> None:
        """Enter ``seq``'s full blocks whose tokens are all computed into the prefix cache (after a step)."""
        if not self.enable_caching:
            return
        block_size, token_ids = self.block_size, seq.token_ids
        blocks, prefix_ids = self.seq_to_blocks[seq.seq_id], self._prefix_ids[seq.seq_id]
        parent = prefix_ids[-1] if prefix_ids else self._root_prefix_id(seq)
        for block_idx in range(len(prefix_ids), seq.num_computed_tokens // block_size):
            start = block_idx * block_size
            block_hash = BlockHash((parent, tuple(token_ids[start : start + block_size])))
            parent = self.block_pool.cache_full_block(blocks[block_idx], block_hash)
            prefix_ids.append(parent)

    def trim_slots(self, seq: Sequence) -> None:
        """Shrink ``seq``'s table to its computed tokens: blocks past ``ceil(num_computed_tokens / block_size)``
        are freed (last first) and the slots after ``num_computed_tokens`` count as empty again.

        Used after speculative verification: the slots of rejected draft tokens are rolled back (later
        tokens overwrite them) and blocks that held only rejected drafts go back to the pool. Those blocks
        were written this step, so they are neither shared nor cached.
        """
        blocks = self.seq_to_blocks[seq.seq_id]
        num_kept = cdiv(seq.num_computed_tokens, self.block_size)
        rejected = blocks[num_kept:]
        del blocks[num_kept:]
        self.block_pool.free_blocks(reversed(rejected))
        self._num_slots[seq.seq_id] = seq.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks, last block first (so its tail is evicted first); no-op if it has none."""
        blocks = self.seq_to_blocks.pop(seq.seq_id, None)
        if blocks is None:
            return
        del self._seqs[seq.seq_id], self._num_slots[seq.seq_id], self._prefix_ids[seq.seq_id]
        self._long_rope.pop(seq.seq_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        if self._blocks_to_copy:
            pool_blocks = self.block_pool.blocks
            self._blocks_to_copy = [(src, dst) for src, dst in self._blocks_to_copy if pool_blocks[dst].ref_cnt > 0]

    def get_block_ids(self, seq_id: int) -> list[int]:
        """Physical block ids of ``seq_id``'s block table, in logical order."""
        return [block.block_id for block in self.seq_to_blocks[seq_id]]

    def slot_occupancy(self) -> SlotOccupancy:
        """Tokens stored and slots over the blocks sequences reference now (0 slots when none is used).

        Blocks before a table's ``num_computed_tokens // block_size`` are full; a later block (forks may
        share one) holds as many tokens as the sharer that computed the most of it.
        """
        block_size = self.block_size
        num_used = self.block_pool.num_blocks - self.block_pool.get_num_free_blocks() - (self.null_block is not None)
        num_slots = num_used * block_size
        filled: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            blocks, num_computed = self.seq_to_blocks[seq_id], seq.num_computed_tokens
            for block_idx in range(num_computed // block_size, len(blocks)):
                block_id = blocks[block_idx].block_id
                num_filled = min(max(num_computed - block_idx * block_size, 0), block_size)
                filled[block_id] = max(filled.get(block_id, 0), num_filled)
        num_empty = sum(block_size - num_filled for num_filled in filled.values())
        return SlotOccupancy(num_tokens_stored=num_slots - num_empty, num_slots=num_slots)

    def check_invariants(self) -> None:
        """Assert the invariants of docs/engine.md, "Invariants": pool consistency, ref counts = table references, table sizes, cached
        contents; a block about to be written (slots allocated past ``num_computed_tokens``) is not shared;
        recorded copies go into distinct, referenced blocks; with a sliding window, no table holds a block
        wholly before its window, and the null block (one pinning reference more) is never cached."""
        self.block_pool.check_invariants()
        references = Counter(id(block) for blocks in self.seq_to_blocks.values() for block in blocks)
        if self.null_block is not None:
            references[id(self.null_block)] += 1
            assert self.null_block.block_hash is None, "the null block is cached"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == references[id(block)], f"block {block.block_id} ref_cnt != table references"
        block_size = self.block_size
        for seq_id, blocks in self.seq_to_blocks.items():
            seq, num_slots, prefix_ids = self._seqs[seq_id], self._num_slots[seq_id], self._prefix_ids[seq_id]
            assert len(blocks) == cdiv(num_slots, block_size), "block table does not cover its tokens exactly"
            assert seq.num_computed_tokens <= num_slots <= seq.num_tokens + len(seq.spec_token_ids)
            assert len(prefix_ids) * block_size <= seq.num_computed_tokens
            for block_idx, block in enumerate(blocks[: len(prefix_ids)]):
                if block.block_hash is None:
                    continue
                parent = prefix_ids[block_idx - 1] if block_idx else self._root_prefix_id(seq)
                start = block_idx * block_size
                assert block.block_hash == (parent, tuple(seq.token_ids[start : start + block_size])), (
                    "cached block content"
                )
                assert block.prefix_id == prefix_ids[block_idx]
            assert all(block.block_hash is None for block in blocks[len(prefix_ids) :]), "uncomputed block is cached"
            if num_slots > seq.num_computed_tokens:
                written = blocks[seq.num_computed_tokens // block_size :]
                assert all(block.ref_cnt == 1 for block in written), "a shared block is about to be written"
            if self.sliding_window is not None and num_slots > seq.num_computed_tokens:
                # allocate_slots ran this step: it freed what lies before the window of the next token.
                num_skipped = max(0, (seq.num_computed_tokens - self.sliding_window + 1) // block_size)
                assert all(block is self.null_block for block in blocks[:num_skipped]), "a block before the window"
                assert self.null_block not in blocks[num_skipped:], "the null block inside the window"
        dsts = [dst for _, dst in self._blocks_to_copy]
        assert len(set(dsts)) == len(dsts), "two copies into one block"
        assert all(self.block_pool.blocks[dst].ref_cnt > 0 for dst in dsts), "a copy into a free block"

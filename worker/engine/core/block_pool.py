"""The pool of KV cache blocks: ref counts, an LRU free queue and the prefix-cache map (pure Python).

Follows vLLM V1's ``BlockPool`` (docs.vllm.ai, "Automatic Prefix Caching" design): every physical block
is a :class:`KVCacheBlock`; blocks with ``ref_cnt == 0`` sit in a free queue, an intrusive doubly-linked
list, so a cached free block that gets hit again can be removed from the middle in O(1). Allocation pops
the head (least recently freed), freeing appends at the tail, so callers free a request's blocks in
reverse order to get its tail evicted first.

Prefix caching keys a full block by ``BlockHash = (parent_prefix_id, token_ids)``: the exact tokens are
part of the key (a dict compares keys by equality, so a hash collision can never return a wrong block)
and ``parent_prefix_id`` is an id the pool hands out once per distinct cached prefix (hash-consing), so
the key identifies the whole prefix exactly, not just this block's tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NewType

BlockId = NewType("BlockId", int)
PrefixId = NewType("PrefixId", int)
BlockHash = NewType("BlockHash", tuple[PrefixId, tuple[int, ...]])

ROOT_PREFIX_ID = PrefixId(0)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots in every layer's cache.

    ``block_hash`` / ``prefix_id`` are set while the block is in the prefix cache (full and computed);
    ``prev_free_block`` / ``next_free_block`` link it into the free queue while ``ref_cnt == 0``.
    """

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prefix_id: PrefixId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks between two sentinels: O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(BlockId(-1))
        self._tail = KVCacheBlock(BlockId(-1))
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the least recently freed block). Raises IndexError when empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise IndexError("no free KV cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, "block is not in the free queue"
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free_block


class BlockPool:
    """All KV blocks of one cache, their free queue and (with ``enable_caching``) the prefix cache.

    ``cached_block_hash_to_block`` maps the :data:`BlockHash` of every full, computed, cached block to
    it; a cached block stays there while free, until allocation reuses (evicts) it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._next_prefix_id = ROOT_PREFIX_ID + 1
        self.num_evictions = 0
        self._num_used_peak = 0

    def take_num_used_peak(self) -> int:
        """Most blocks referenced at once since the last call (take and reset to the blocks referenced now)."""
        peak, self._num_used_peak = self._num_used_peak, self.num_blocks - self.free_block_queue.num_free_blocks
        return peak

    def _note_used(self) -> None:
        self._num_used_peak = max(self._num_used_peak, self.num_blocks - self.free_block_queue.num_free_blocks)

    def get_num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks off the free queue's head, evicting their cached content; ``ref_cnt = 1``.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.free_block_queue.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        self._note_used()
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.prefix_id = None
        self.num_evictions += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block holding exactly this prefix, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
        self._note_used()

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> PrefixId:
        """Enter a full, computed block into the prefix cache; returns the prefix id of its contents.

        If the same prefix is already cached in another block (two requests computed it at the same
        time), that block stays the cached one and its prefix id is returned; ``block`` stays uncached.
        """
        assert self.enable_caching and block.ref_cnt > 0
        existing = self.cached_block_hash_to_block.get(block_hash)
        if existing is not None:
            assert existing.prefix_id is not None
            return existing.prefix_id
        prefix_id = PrefixId(self._next_prefix_id)
        self._next_prefix_id += 1
        block.block_hash = block_hash
        block.prefix_id = prefix_id
        self.cached_block_hash_to_block[block_hash] = block
        return prefix_id

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 go to the free queue's tail in the given order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def check_invariants(self) -> None:
        """Assert the pool's own invariants (docs/engine.md, "Invariants"): free + used = total, free blocks
        have ref 0, cache map consistent."""
        free = list(self.free_block_queue)
        assert len(free) == self.free_block_queue.num_free_blocks
        assert len({id(b) for b in free}) == len(free), "a block is twice in the free queue"
        assert all(block.ref_cnt == 0 for block in free), "a free block has references"
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        assert num_used + len(free) == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
            assert len(block_hash[1]) == self.block_size, "a cached block is not full"
        num_cached = sum(1 for block in self.blocks if block.block_hash is not None)
        assert num_cached == len(self.cached_block_hash_to_block)

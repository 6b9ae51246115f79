"""BlockPool: LRU free queue with O(1) middle removal, ref counts, prefix-cache map (property-tested)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worker.engine.core.block_pool import ROOT_PREFIX_ID, BlockHash, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_pops_head_appends_tail_and_removes_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 0, 2]
    assert queue.num_free_blocks == 5


def test_allocation_takes_least_recently_freed_and_evicts_its_cache_entry():
    pool = BlockPool(num_blocks=3, block_size=2, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    block_hash = BlockHash((ROOT_PREFIX_ID, (7, 8)))
    prefix_id = pool.cache_full_block(a, block_hash)
    pool.free_blocks(reversed([a, b]))  # a request's tail goes first, so b is evicted before a
    assert [blk.block_id for blk in pool.free_block_queue] == [b.block_id, a.block_id]
    assert pool.get_cached_block(block_hash) is a and a.prefix_id == prefix_id
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(block_hash) is a
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(block_hash) is None and a.block_hash is None
    assert pool.num_evictions == 1
    with pytest.raises(ValueError, match="free"):
        pool.get_new_blocks(1)
    del c


def test_touching_a_free_cached_block_removes_it_from_the_free_queue():
    pool = BlockPool(num_blocks=4, block_size=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, BlockHash((ROOT_PREFIX_ID, (1, 2))))
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 4
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    assert block not in list(pool.free_block_queue)
    pool.check_invariants()


def test_same_prefix_cached_twice_keeps_the_first_block_and_shares_its_prefix_id():
    pool = BlockPool(num_blocks=2, block_size=2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    block_hash = BlockHash((ROOT_PREFIX_ID, (3, 3)))
    prefix_id = pool.cache_full_block(first, block_hash)
    assert pool.cache_full_block(second, block_hash) == prefix_id
    assert second.block_hash is None and pool.get_cached_block(block_hash) is first
    pool.check_invariants()


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/touch/free/cache sequences; the pool's invariants and a reference model hold throughout."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=8, block_size=2, enable_caching=True)
        self.held: list[KVCacheBlock] = []  # one entry per reference we own

    @rule(num_blocks=st.integers(1, 4))
    def allocate(self, num_blocks):
        num_free = self.pool.get_num_free_blocks()
        if num_blocks > num_free:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num_blocks)
            return
        expected_order = list(self.pool.free_block_queue)[:num_blocks]
        new_blocks = self.pool.get_new_blocks(num_blocks)
        assert new_blocks == expected_order
        assert all(block.ref_cnt == 1 and block.block_hash is None for block in new_blocks)
        self.held.extend(new_blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data):
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free_blocks([block])
        if block.ref_cnt == 0:
            assert list(self.pool.free_block_queue)[-1] is block

    @precondition(lambda self: self.held)
    @rule(data=st.data(), tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)))
    def cache(self, data, tokens):
        block = data.draw(st.sampled_from(self.held))
        if block.block_hash is None:
            self.pool.cache_full_block(block, BlockHash((ROOT_PREFIX_ID, tokens)))

    @rule(tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)))
    def hit(self, tokens):
        block = self.pool.get_cached_block(BlockHash((ROOT_PREFIX_ID, tokens)))
        if block is not None:
            self.pool.touch([block])
            self.held.append(block)

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for block in self.pool.blocks:
            assert block.ref_cnt == sum(1 for held in self.held if held is block)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

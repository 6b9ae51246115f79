"""KVCacheManager: block tables sized exactly, ref counts, prefix-cache hits and copy-on-write forks
that read the right KV.

A shadow cache records, for every slot written, the token prefix whose K/V it holds; every computed
position of every sequence must then read exactly its own prefix, whatever allocation, forks, block
copies, preemption, prefix hits and evictions happened before. That is "caching and forking are
invisible" at the bookkeeping level.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from worker.engine.core.kv_cache_manager import KVCacheManager, SlotOccupancy
from worker.engine.core.request import Sequence
from worker.engine.executor.model_runner import copy_blocks
from worker.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
# Prompts made of a few block-sized chunks so that prefix hits (and near misses) are common.
CHUNKS = [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 0, 1)]
prompts = st.builds(
    lambda chunks, tail: [token for chunk in chunks for token in chunk] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=5),
    st.lists(st.integers(0, 1), min_size=1, max_size=5),
)


def make_seq(seq_id, tokens, prompt_logprobs=None):
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    return Sequence(seq_id, f"req-{seq_id}", 0, params, list(tokens))


def test_slot_occupancy_counts_computed_tokens_against_referenced_slots():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    assert kv.slot_occupancy() == SlotOccupancy(0, 0)
    first, second = make_seq(0, range(6)), make_seq(1, range(9))
    assert kv.allocate_slots(first, 6) and kv.allocate_slots(second, 9)
    first.num_computed_tokens, second.num_computed_tokens = 6, 5  # second's last chunk not run yet
    assert kv.slot_occupancy() == SlotOccupancy(11, 5 * BLOCK_SIZE)
    kv.free(first)
    assert kv.slot_occupancy() == SlotOccupancy(5, 3 * BLOCK_SIZE)


def test_allocation_is_on_demand_and_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE, enable_caching=False)
    seq = make_seq(0, range(9))
    assert kv.allocate_slots(seq, 5)
    assert len(kv.get_block_ids(0)) == 2
    seq.num_computed_tokens = 5
    assert not kv.allocate_slots(seq, 4 + 4 * BLOCK_SIZE)  # would need 4 more blocks
    assert len(kv.get_block_ids(0)) == 2 and kv.num_free_blocks == 1
    assert kv.allocate_slots(seq, 4)
    assert len(kv.get_block_ids(0)) == 3 and kv.num_free_blocks == 0
    seq.num_computed_tokens = 9
    kv.check_invariants()
    kv.free(seq)
    assert kv.num_free_blocks == 3
    kv.check_invariants()


def test_second_request_with_same_prefix_hits_full_blocks_only_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_seq(0, range(10))
    assert kv.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    kv.cache_blocks(first)
    second = make_seq(1, list(range(8)) + [99, 98])
    blocks, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 8 and blocks == kv.seq_to_blocks[0][:2]
    exact = make_seq(2, range(8))  # a prompt of exactly two blocks: the last token must still be computed
    assert kv.get_computed_blocks(exact)[1] == 4
    assert kv.get_computed_blocks(make_seq(3, range(8), prompt_logprobs=1)) == ([], 0)
    assert kv.allocate_slots(second, 2, blocks)
    second.num_computed_tokens = 8
    assert [b.ref_cnt for b in kv.seq_to_blocks[1]] == [2, 2, 1]
    kv.check_invariants()


def test_different_earlier_block_means_no_hit_even_with_equal_block_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_seq(0, [1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_blocks(first)
    other = make_seq(1, [2, 2, 2, 2, 5, 5, 5, 5, 0])
    assert kv.get_computed_blocks(other) == ([], 0)


def fork_seq(kv, parent, child_id):
    child = make_seq(child_id, parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    return child


def test_fork_shares_every_block_and_a_write_copies_only_the_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    parent = make_seq(0, range(6))  # one full block and a partial one (2 of 4 slots)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    children = [fork_seq(kv, parent, 1), fork_seq(kv, parent, 2)]
    assert [b.ref_cnt for b in kv.seq_to_blocks[0]] == [3, 3]
    assert kv.num_free_blocks == 6
    kv.check_invariants()

    # Fake one-layer cache: slot value = 100 * seq_id + position, written through each block table.
    cache = torch.zeros(2, 8, BLOCK_SIZE, 1, 1)
    for pos in range(6):
        cache[:, kv.get_block_ids(0)[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = pos
    first = children[0]
    first.append_token(7)
    assert kv.allocate_slots(first, 1)
    blocks_to_copy = kv.take_blocks_to_copy()
    assert len(blocks_to_copy) == 1
    src, dst = blocks_to_copy[0]
    assert src == kv.get_block_ids(0)[1] and dst == kv.get_block_ids(1)[1] and src != dst
    assert kv.get_block_ids(1)[0] == kv.get_block_ids(0)[0]  # the full block stays shared
    kv.check_invariants()
    copy_blocks([cache], blocks_to_copy)
    cache[:, dst, 6 % BLOCK_SIZE] = 100 + 6  # the child's write
    first.num_computed_tokens = 7

    def read(seq_id, num_tokens):
        ids = kv.get_block_ids(seq_id)
        return [cache[0, ids[p // BLOCK_SIZE], p % BLOCK_SIZE, 0, 0].item() for p in range(num_tokens)]

    assert read(1, 7) == [0, 1, 2, 3, 4, 5, 106]
    assert read(0, 6) == read(2, 6) == [0, 1, 2, 3, 4, 5]
    assert cache[0, src, 6 % BLOCK_SIZE].item() == 0  # the shared block itself is untouched
    assert kv.take_blocks_to_copy() == []


def test_last_holder_of_a_shared_block_writes_in_place_and_freeing_drops_own_references_only():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=True)
    parent = make_seq(0, range(6))
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.cache_blocks(parent)
    child = fork_seq(kv, parent, 1)
    for seq, token in ((parent, 8), (child, 9)):
        seq.append_token(token)
        assert kv.allocate_slots(seq, 1)
    assert len(kv.take_blocks_to_copy()) == 1  # the parent copied; the child then held the block alone
    kv.check_invariants()
    full = kv.seq_to_blocks[0][0]
    assert full is kv.seq_to_blocks[1][0] and full.block_hash is not None and full.ref_cnt == 2
    kv.free(child)
    assert full.ref_cnt == 1 and kv.num_free_blocks == 8 - 2
    kv.check_invariants()


def test_fork_rejects_a_child_with_blocks_or_another_position():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    parent = make_seq(0, range(5))
    assert kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.fork(parent, make_seq(1, range(5)))
    child = fork_seq(kv, parent, 2)
    with pytest.raises(ValueError, match="already holds"):
        kv.fork(parent, child)


def test_copy_into_a_block_freed_in_the_same_step_is_dropped():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    parent = make_seq(0, range(5))
    assert kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    child = fork_seq(kv, parent, 1)
    child.append_token(3)
    assert kv.allocate_slots(child, 1)
    kv.free(child)  # preempted later in the same step
    assert kv.take_blocks_to_copy() == []
    kv.check_invariants()


def test_slot_occupancy_counts_a_shared_partial_block_once():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    parent = make_seq(0, range(6))
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    fork_seq(kv, parent, 1)
    assert kv.slot_occupancy() == SlotOccupancy(6, 2 * BLOCK_SIZE)


class KVCacheMachine(RuleBasedStateMachine):
    """Random interleavings of admit (with prefix lookup), compute, decode, fork, preempt and finish."""

    seqs = Bundle("seqs")
    sliding_window: int | None = None
    num_blocks = 10

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(
            num_blocks=self.num_blocks, block_size=BLOCK_SIZE, enable_caching=True, sliding_window=self.sliding_window
        )
        self.next_seq_id = 0
        self.pending: dict[int, int] = {}  # seq_id -> slots allocated, not yet computed
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}  # (block_id, offset) -> prefix held

    @rule(target=seqs, tokens=prompts)
    def add(self, tokens):
        seq = make_seq(self.next_seq_id, tokens)
        self.next_seq_id += 1
        return seq

    @rule(seq=seqs, data=st.data())
    def schedule(self, seq, data):
        if self.pending.get(seq.seq_id) or seq.num_computed_tokens == seq.num_tokens:
            return
        holds_blocks = seq.seq_id in self.kv.seq_to_blocks
        blocks, num_cached = ([], 0) if holds_blocks else self.kv.get_computed_blocks(seq)
        start = seq.num_computed_tokens + num_cached
        num_new = data.draw(st.integers(1, seq.num_tokens - start))
        num_free = self.kv.num_free_blocks
        if self.kv.allocate_slots(seq, num_new, blocks):
            seq.num_computed_tokens = start
            self.pending[seq.seq_id] = num_new
        elif self.sliding_window is None:
            assert self.kv.num_free_blocks == num_free
        else:  # blocks before the window go back to the pool even when the allocation fails
            assert self.kv.num_free_blocks >= num_free
        # The runner copies blocks before the step's writes; here the copy happens at once.
        for src, dst in self.kv.take_blocks_to_copy():
            for offset in range(BLOCK_SIZE):
                if (src, offset) in self.shadow:
                    self.shadow[dst, offset] = self.shadow[src, offset]
                else:
                    self.shadow.pop((dst, offset), None)

    @rule(target=seqs, parent=seqs, tail=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def fork(self, parent, tail):
        """A branch off a sequence with nothing pending: shares its blocks, then goes its own way."""
        if parent.seq_id not in self.kv.seq_to_blocks or self.pending.get(parent.seq_id):
            return multiple()
        child = make_seq(self.next_seq_id, parent.token_ids[: parent.num_computed_tokens] + tail)
        self.next_seq_id += 1
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        return child

    @rule(seq=seqs, next_token=st.integers(0, 1))
    def compute(self, seq, next_token):
        num_new = self.pending.pop(seq.seq_id, 0)
        if not num_new:
            return
        block_ids = self.kv.get_block_ids(seq.seq_id)
        start = seq.num_computed_tokens
        for pos in range(start, start + num_new):
            self.shadow[block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += num_new
        for pos in range(self._first_read(start), seq.num_computed_tokens):  # what attention would read
            assert self.shadow[block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] == tuple(seq.token_ids[: pos + 1])
        self.kv.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens and seq.num_tokens < 40:
            seq.append_token(next_token)

    @rule(seq=seqs)
    def preempt(self, seq):
        self.kv.free(seq)
        self.pending.pop(seq.seq_id, None)
        seq.num_computed_tokens = 0

    @rule(seq=consumes(seqs))
    def finish(self, seq):
        self.preempt(seq)

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        for seq_id, blocks in self.kv.seq_to_blocks.items():  # every holder reads its own history
            seq = self.kv._seqs[seq_id]
            for pos in range(self._first_read(seq.num_computed_tokens), seq.num_computed_tokens):
                held = self.shadow[blocks[pos // BLOCK_SIZE].block_id, pos % BLOCK_SIZE]
                assert held == tuple(seq.token_ids[: pos + 1])

    def _first_read(self, query_position: int) -> int:
        """The earliest position a query at ``query_position`` (or later) reads."""
        return 0 if self.sliding_window is None else max(0, query_position - self.sliding_window + 1)


class SlidingWindowKVCacheMachine(KVCacheMachine):
    """The same with a window of 5 tokens (not a multiple of the block size): blocks wholly before it are freed
    (``check_invariants`` asserts it) while every position a query can still see reads its own history."""

    sliding_window = 5
    num_blocks = 16


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestSlidingWindowKVCacheMachine = SlidingWindowKVCacheMachine.TestCase
TestSlidingWindowKVCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_sliding_window_frees_blocks_behind_the_window_and_keeps_table_indices():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False, sliding_window=6)
    assert kv.num_free_blocks == 7  # one block is the null block
    seq = make_seq(0, range(30))
    assert kv.allocate_slots(seq, 12)
    seq.num_computed_tokens = 12
    assert kv.num_free_blocks == 4
    # The next token (position 12) sees positions 7..12: block 0 (0..3) is behind the window, block 1 (4..7) is not.
    assert kv.allocate_slots(seq, 1)
    table = kv.get_block_ids(seq.seq_id)
    assert len(table) == 4 and table[0] == kv.null_block.block_id and kv.null_block.block_id not in table[1:]
    assert kv.num_free_blocks == 4  # block 0 freed, block 3 allocated
    kv.check_invariants()
    seq.num_computed_tokens = 13
    assert kv.allocate_slots(seq, 1)  # position 13 sees 8..13: block 1 goes too
    assert kv.get_block_ids(seq.seq_id)[:2] == [kv.null_block.block_id] * 2 and kv.num_free_blocks == 5
    kv.check_invariants()
    kv.free(seq)
    assert kv.num_free_blocks == 7
    kv.check_invariants()


def test_long_rope_classes_never_share_blocks_and_a_short_holder_past_the_limit_needs_recompute():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=True, long_rope_len=10)
    short, long = make_seq(0, range(9)), make_seq(1, range(12))  # same first 8 tokens, other classes
    for seq in (short, long):
        assert kv.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_blocks(seq)
    assert kv.get_computed_blocks(make_seq(2, range(9)))[1] == 8  # a short twin hits the short blocks
    long_twin = make_seq(3, range(12))
    hits, _ = kv.get_computed_blocks(long_twin)
    assert [b.block_id for b in hits] == kv.get_block_ids(long.seq_id)[:2]  # the long blocks, not the short ones
    assert not kv.needs_recompute(short) and not kv.needs_recompute(long)
    short.append_token(9)
    assert kv.allocate_slots(short, 1)
    short.num_computed_tokens = 10
    assert not kv.needs_recompute(short)  # 10 tokens: still within the limit
    short.append_token(10)
    assert kv.needs_recompute(short) and not kv.needs_recompute(long)
    kv.check_invariants()
    kv.free(short)
    assert not kv.needs_recompute(short)

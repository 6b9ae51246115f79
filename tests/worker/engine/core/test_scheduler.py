"""Scheduler: token budget, decodes first, chunked prefill, youngest-first preemption, aborts, FCFS."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.scheduling import run_step, scheduled
from worker.engine.core.kv_cache_manager import KVCacheManager
from worker.engine.core.request import Sequence, SequenceStatus
from worker.engine.core.scheduler import Scheduler
from worker.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, enable_caching=False):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(kv, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)


def make_seq(seq_id, num_prompt_tokens, max_tokens=4, first_token=0):
    prompt = [first_token + i % 7 for i in range(num_prompt_tokens)]
    return Sequence(seq_id, f"req-{seq_id}", 0, SamplingParams(max_tokens=max_tokens), prompt)


def test_long_prompt_is_chunked_under_the_budget_and_continues_next_step():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    seq = make_seq(0, 25)
    scheduler.add_seq(seq)
    assert scheduled(run_step(scheduler)) == [(0, 10)]
    assert seq.output_token_ids == []
    assert scheduled(run_step(scheduler)) == [(0, 10)]
    assert scheduled(run_step(scheduler)) == [(0, 5)]
    assert seq.output_token_ids == [25 % 5]  # sampled once the prefill completed
    assert scheduled(run_step(scheduler)) == [(0, 1)]


def test_decodes_come_first_and_the_budget_is_never_exceeded():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for seq_id in range(3):
        scheduler.add_seq(make_seq(seq_id, 3, max_tokens=8))
    assert scheduled(run_step(scheduler)) == [(0, 3), (1, 3), (2, 3)]
    scheduler.add_seq(make_seq(3, 30))
    out = run_step(scheduler)
    assert scheduled(out) == [(0, 1), (1, 1), (2, 1), (3, 7)]
    assert out.total_num_scheduled_tokens == 10


def test_waiting_requests_are_admitted_first_come_first_served_up_to_max_num_seqs():
    scheduler = make_scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    for seq_id in range(4):
        scheduler.add_seq(make_seq(seq_id, 2 + seq_id))
    assert [seq.seq_id for seq in run_step(scheduler).seqs] == [0, 1]
    assert [seq.seq_id for seq in scheduler.waiting] == [2, 3]


def test_out_of_blocks_preempts_the_youngest_running_and_requeues_it_first():
    # 4 blocks of 4 slots: two sequences of 7 prompt tokens fill them after one decode each.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    old, young, waiting = make_seq(0, 7, max_tokens=6), make_seq(1, 7, max_tokens=6), make_seq(2, 2)
    for seq in (old, young, waiting):
        scheduler.add_seq(seq)
    run_step(scheduler)  # 7 + 7 prompt tokens -> 2 blocks each, pool full; `waiting` cannot get a block
    assert [seq.seq_id for seq in scheduler.running] == [0, 1]
    run_step(scheduler)  # positions 7: still inside block 2 of each
    out = run_step(scheduler)  # position 8 needs a third block for `old`: `young` is preempted
    assert [seq.seq_id for seq in out.preempted_seqs] == [1]
    assert scheduled(out) == [(0, 1)]
    assert young.status is SequenceStatus.PREEMPTED and young.num_computed_tokens == 0
    assert [seq.seq_id for seq in scheduler.waiting] == [1, 2]
    assert young.seq_id not in scheduler.kv_cache_manager.seq_to_blocks
    assert scheduler.make_stats().num_preemptions == 1
    assert scheduler.stats.num_preemptions == 0  # taken and reset
    generated = list(young.output_token_ids)
    assert len(generated) == 2
    while scheduler.has_unfinished_seqs():
        run_step(scheduler)
    assert young.output_token_ids[:2] == generated  # recomputed, not regenerated
    assert all(seq.is_finished for seq in (old, young, waiting))


def test_a_sequence_preempts_itself_when_it_is_the_youngest():
    scheduler = make_scheduler(num_blocks=2, max_num_batched_tokens=64)
    old, young = make_seq(0, 4, max_tokens=8), make_seq(1, 3, max_tokens=8)
    scheduler.add_seq(old)
    scheduler.add_seq(young)
    run_step(scheduler)
    out = run_step(scheduler)  # old needs a second block; young (holding it) is preempted, old proceeds
    assert [seq.seq_id for seq in out.preempted_seqs] == [1]
    assert scheduled(out) == [(0, 1)]


def test_abort_frees_blocks_of_running_and_waiting_sequences():
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=6)
    running, waiting = make_seq(0, 6), make_seq(1, 9)
    scheduler.add_seq(running)
    scheduler.add_seq(waiting)
    run_step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    scheduler.finish_seqs([running, waiting])
    assert not scheduler.has_unfinished_seqs()
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert running.is_finished and waiting.is_finished
    scheduler.kv_cache_manager.check_invariants()


def test_prefix_cache_hit_skips_computed_blocks_and_counts_cached_tokens():
    scheduler = make_scheduler(enable_caching=True)
    first, second = make_seq(0, 10), make_seq(1, 10)
    scheduler.add_seq(first)
    run_step(scheduler)
    scheduler.add_seq(second)
    out = run_step(scheduler)
    assert scheduled(out) == [(0, 1), (1, 2)]
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0


@settings(max_examples=40, deadline=None)
@given(
    workload=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 3)), min_size=1, max_size=10),
    num_blocks=st.integers(10, 24),
    max_num_batched_tokens=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    enable_caching=st.booleans(),
)
def test_any_workload_runs_to_completion_within_budget(
    workload, num_blocks, max_num_batched_tokens, max_num_seqs, enable_caching
):
    scheduler = make_scheduler(num_blocks, max_num_batched_tokens, max_num_seqs, enable_caching)
    seqs = [make_seq(i, prompt_len, max_tokens, first) for i, (prompt_len, max_tokens, first) in enumerate(workload)]
    for seq in seqs:
        scheduler.add_seq(seq)
    for _ in range(2000):
        if not scheduler.has_unfinished_seqs():
            break
        out = run_step(scheduler)
        assert 0 < out.total_num_scheduled_tokens <= max_num_batched_tokens
        assert len(scheduler.running) <= max_num_seqs
    assert all(seq.is_finished and len(seq.output_token_ids) == seq.params.max_tokens for seq in seqs)
    # The fake model's tokens depend only on position, so preemption and caching change nothing.
    assert all(seq.output_token_ids == [p % 5 for p in range(seq.num_prompt_tokens, seq.num_tokens)] for seq in seqs)
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks


def make_forking_seq(seq_id, num_prompt_tokens, num_branches, max_tokens=3):
    params = SamplingParams(n=num_branches, temperature=1.0, max_tokens=max_tokens)
    prompt = [i % 7 for i in range(num_prompt_tokens)]
    seqs = [Sequence(seq_id + k, f"req-{seq_id}", k, params, prompt) for k in range(num_branches)]
    seqs[0].pending_forks = seqs[1:]
    for seq in seqs[1:]:
        seq.status = SequenceStatus.FORK_PENDING
    return seqs


def test_branches_fork_when_the_prompt_completes_and_share_its_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    parent, *children = make_forking_seq(0, 6, 3)
    scheduler.add_seq(parent)
    out = run_step(scheduler)  # first chunk: no fork yet
    assert out.forks == [] and all(c.status is SequenceStatus.FORK_PENDING for c in children)
    out = scheduler.schedule()
    assert out.forks == [(parent, children)]
    scheduler.update_from_output(out)
    kv = scheduler.kv_cache_manager
    assert [kv.get_block_ids(c.seq_id) for c in children] == [kv.get_block_ids(0)] * 2
    assert [b.ref_cnt for b in kv.seq_to_blocks[0]] == [3, 3]
    assert [s.seq_id for s in scheduler.running] == [0, 1, 2] and parent.pending_forks == []
    for k, seq in enumerate([parent, *children]):
        seq.append_token(k)
    kv.check_invariants()
    out = run_step(scheduler)  # every branch writes position 6, inside the shared partial block
    assert scheduled(out) == [(0, 1), (1, 1), (2, 1)]
    assert len(out.blocks_to_copy) == 2  # the last writer owns the block alone by then
    while scheduler.has_unfinished_seqs():
        run_step(scheduler)
    assert kv.num_free_blocks == 64


def test_pending_forks_count_against_max_num_seqs_at_admission():
    scheduler = make_scheduler(max_num_seqs=4)
    scheduler.add_seq(make_seq(0, 3, max_tokens=8))
    run_step(scheduler)
    parent, *_ = make_forking_seq(10, 3, 4)
    scheduler.add_seq(parent)
    assert scheduled(run_step(scheduler)) == [(0, 1)]  # 1 running + 4 branches > 4
    while scheduler.running:
        run_step(scheduler)
    assert [seq.seq_id for seq in run_step(scheduler).seqs] == [10]  # alone, it may exceed the cap

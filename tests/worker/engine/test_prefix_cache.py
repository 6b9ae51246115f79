"""Prefix caching end to end: cached-block invariants, LRU eviction, shared-prefix grouping, the scheduler's
sibling hold and cache preference, counters, and outputs identical with the cache on, off, cold and warm
(after a stop string inside a shared block, and under eviction pressure)."""

import random

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.parity import assert_greedy_close, hf_greedy_reference
from tests.helpers.scheduling import run_step, scheduled
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.core.kv_cache_manager import KVCacheManager
from worker.engine.core.request import Sequence
from worker.engine.core.scheduler import Scheduler
from worker.engine.executor.layers.attention import cascade as cascade_attention
from worker.prefix_grouping import order_by_shared_prefix

BLOCK_SIZE = 4


# ---------------------------------------------------------------- pure Python: scheduler + KV cache manager


def make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, enable_caching=True):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(kv, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)


def make_seq(seq_id, tokens, max_tokens=2):
    return Sequence(seq_id, f"req-{seq_id}", 0, SamplingParams(max_tokens=max_tokens), list(tokens))


PREFIX = [7, 8, 9, 10] * 3  # three full blocks


def test_siblings_wait_one_step_for_the_shared_prefix_then_hit_it():
    scheduler = make_scheduler()
    siblings = [make_seq(i, PREFIX + [20 + i, 30 + i]) for i in range(4)]
    loner = make_seq(9, [1, 2, 3, 4, 5, 6])
    for seq in [*siblings, loner]:
        scheduler.add_seq(seq)
    assert scheduled(run_step(scheduler)) == [(0, 14), (9, 6)]  # siblings held, the loner is not
    assert scheduler.stats.num_prefix_holds == 3
    assert scheduled(run_step(scheduler)) == [(0, 1), (9, 1), (1, 2), (2, 2), (3, 2)]
    assert [seq.num_cached_tokens for seq in siblings] == [0, 12, 12, 12]
    kv = scheduler.kv_cache_manager
    taken = kv.make_prefix_cache_stats()
    assert (taken.queries, taken.hits) == (4 * 14 + 6, 3 * 12)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (0, 0)  # taken and reset
    shared = kv.seq_to_blocks[1][:3]
    assert all(block.ref_cnt == 3 for block in shared)  # seq 0 finished; 1, 2, 3 share its blocks
    assert [b.block_id for b in kv.seq_to_blocks[2][:3]] == [b.block_id for b in shared]


def test_without_caching_nothing_is_held():
    scheduler = make_scheduler(enable_caching=False)
    for i in range(3):
        scheduler.add_seq(make_seq(i, PREFIX + [20 + i]))
    assert scheduled(run_step(scheduler)) == [(0, 13), (1, 13), (2, 13)]
    assert scheduler.stats.num_prefix_holds == 0
    assert scheduler.kv_cache_manager.prefix_cache_stats.queries == 0


def test_hold_lasts_only_until_the_owner_prefill_passes_the_shared_blocks():
    # Budget 6: the owner's 14-token prompt takes three chunked steps; the sibling is held while the
    # owner's next block is the sibling's next block, and joins as soon as all three are cached.
    scheduler = make_scheduler(max_num_batched_tokens=6)
    owner, sibling = make_seq(0, PREFIX + [20, 21]), make_seq(1, PREFIX + [30, 31])
    scheduler.add_seq(owner)
    scheduler.add_seq(sibling)
    assert scheduled(run_step(scheduler)) == [(0, 6)]
    assert scheduled(run_step(scheduler)) == [(0, 6)]
    assert scheduled(run_step(scheduler)) == [(0, 2), (1, 2)]
    assert sibling.num_cached_tokens == 12


def test_waiting_requests_with_the_longest_cached_prefix_go_first_but_the_head_is_not_starved():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    warm = make_seq(0, PREFIX + [1])
    scheduler.add_seq(warm)
    while scheduler.has_unfinished_seqs():
        run_step(scheduler)
    cold = make_seq(1, [40 + i for i in range(15)], max_tokens=1)
    hits = [make_seq(2 + i, PREFIX + [50 + i, 60 + i], max_tokens=1) for i in range(4)]
    for seq in [cold, *hits]:
        scheduler.add_seq(seq)
    # The four cache hits go first and take all four seats; the cold head is passed over.
    assert scheduled(run_step(scheduler)) == [(2, 2), (3, 2), (4, 2), (5, 2)]
    more_hits = [make_seq(6 + i, PREFIX + [70 + i, 80 + i], max_tokens=1) for i in range(4)]
    for seq in more_hits:
        scheduler.add_seq(seq)
    # Passed over once at the head, the cold request now goes first despite the better hits behind it.
    assert scheduled(run_step(scheduler))[0] == (1, 15)
    while scheduler.has_unfinished_seqs():
        run_step(scheduler)
    assert all(seq.is_finished for seq in [cold, *hits, *more_hits])


def test_finished_requests_leave_cached_blocks_evicted_lru_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    older, newer = make_seq(0, range(9)), make_seq(1, range(100, 109))
    for seq in (older, newer):
        assert kv.allocate_slots(seq, 9)
        seq.num_computed_tokens = 9
        kv.cache_blocks(seq)
    kv.free(older)
    kv.free(newer)
    kv.check_invariants()
    older_ids, newer_ids = [0, 1, 2], [3, 4, 5]
    # Each request's tail first; the earlier-freed request before the later one.
    assert [b.block_id for b in kv.block_pool.free_block_queue] == older_ids[::-1] + newer_ids[::-1]
    # Allocating takes the uncached tail block, then evicts the older request's blocks, last one first.
    taker = make_seq(2, range(200, 212))
    assert kv.allocate_slots(taker, 12)
    assert kv.get_block_ids(2) == [2, 1, 0]
    assert kv.block_pool.num_evictions == 2
    assert kv.get_computed_blocks(make_seq(3, range(9)))[1] == 0
    assert kv.get_computed_blocks(make_seq(4, range(100, 109)))[1] == 8  # the newer prefix survived
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    workload=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=12
    ),
    num_blocks=st.integers(12, 30),
    max_num_batched_tokens=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
)
def test_shared_prefix_workloads_finish_with_exact_cache_invariants(
    workload, num_blocks, max_num_batched_tokens, max_num_seqs
):
    """Prompts = one of three preambles (0..4 blocks of it) + a tail; holds, hits and evictions never
    starve anything, the fake model's position-only tokens are unchanged, and the pool is whole at the end."""
    preambles = [[p * 10 + i % 4 for i in range(4 * BLOCK_SIZE)] for p in range(3)]
    scheduler = make_scheduler(num_blocks, max_num_batched_tokens, max_num_seqs)
    seqs = [
        make_seq(i, preambles[p][: n * BLOCK_SIZE] + [100 + i] * tail, max_tokens)
        for i, (p, n, tail, max_tokens) in enumerate(workload)
    ]
    for seq in seqs:
        scheduler.add_seq(seq)
    bound = sum(seq.num_tokens + seq.params.max_tokens for seq in seqs) * 4 + 50
    for _ in range(bound):
        if not scheduler.has_unfinished_seqs():
            break
        out = run_step(scheduler)
        assert 0 < out.total_num_scheduled_tokens <= max_num_batched_tokens
    assert all(seq.is_finished for seq in seqs)
    assert all(seq.output_token_ids == [p % 5 for p in range(seq.num_prompt_tokens, seq.num_tokens)] for seq in seqs)
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks


# ---------------------------------------------------------------- shared-prefix grouping


def test_order_by_shared_prefix_groups_lines_and_is_stable():
    lines = [[5, 1, 2], [9], [5, 1, 3], [300, 1], [5, 1, 2], [5], [9, 0]]
    order = order_by_shared_prefix(lines)
    assert order == [5, 0, 4, 2, 1, 6, 3]
    assert order_by_shared_prefix([]) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 255, 256, 70000, 2**32 - 1]), min_size=1, max_size=5), max_size=20))
def test_every_shared_prefix_is_one_contiguous_run(lines):
    order = order_by_shared_prefix(lines)
    assert sorted(order) == list(range(len(lines)))
    ordered = [lines[i] for i in order]
    for line in lines:
        for length in range(1, len(line) + 1):
            positions = [k for k, other in enumerate(ordered) if other[:length] == line[:length]]
            assert positions == list(range(positions[0], positions[-1] + 1))


# ---------------------------------------------------------------- the engine on a tiny random Llama

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def job():
    """Ten shuffled lines: two preambles (6 and 3 blocks of 4 tokens, plus a partial block) and tails."""
    rng = random.Random(1)
    preambles = [[rng.randrange(3, 259) for _ in range(26)], [rng.randrange(3, 259) for _ in range(14)]]
    lines = [preambles[i % 2] + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 9))] for i in range(10)]
    rng.shuffle(lines)
    return lines


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 22, max_model_len=64)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def run(engine, prompts, params):
    """Admit ``prompts`` grouped by shared prefix and step to the end, checking invariants every step."""
    order = order_by_shared_prefix(prompts)
    for i in order:
        engine.add_request(str(i), prompts[i], params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
        engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
    return [outputs[str(i)] for i in range(len(prompts))]


def token_ids(outputs):
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


@pytest.fixture(scope="module", params=["auto", "int8"])
def kv_cache_dtype(request):
    """The engine tests below run on the default and on the int8 cache: every path reads the same stored values,
    so caching stays invisible on quantized blocks too."""
    return request.param


@pytest.fixture(scope="module")
def uncached(model_dir, job, kv_cache_dtype):
    engine = make_engine(model_dir, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    return token_ids(run(engine, job, GREEDY)), token_ids(run(engine, job, SEEDED))


def test_cache_on_cold_and_warm_equals_cache_off_and_computes_each_prefix_once(
    model_dir, job, uncached, kv_cache_dtype
):
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    cold = run(engine, job, GREEDY)
    stats = engine.make_stats()
    assert token_ids(cold) == uncached[0]
    assert stats.num_prefix_holds > 0
    # Each preamble's full blocks are computed once: 6 + 3 blocks of 4 tokens are hit 4 times each.
    assert [out.num_cached_tokens for out in cold].count(0) == 2
    assert sum(out.num_cached_tokens for out in cold) == 4 * (24 + 12)
    assert stats.prefix_cache_hits == 4 * (24 + 12)
    assert stats.prefix_cache_queries == sum(len(p) for p in job)
    assert stats.num_prompt_tokens_computed == sum(len(p) for p in job) - 4 * (24 + 12)
    warm = run(engine, job, GREEDY)
    assert token_ids(warm) == uncached[0]
    assert all(out.num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for out, p in zip(warm, job))
    assert token_ids(run(engine, job, SEEDED)) == uncached[1]
    assert token_ids(run(engine, job, SEEDED)) == uncached[1]


def test_cache_under_eviction_pressure_changes_nothing(model_dir, job, uncached, kv_cache_dtype):
    # 20 blocks for 10 lines of up to 43 tokens: preemption and eviction of cached blocks are constant.
    engine = make_engine(model_dir, num_gpu_blocks_override=20, max_model_len=48, kv_cache_dtype=kv_cache_dtype)
    assert token_ids(run(engine, job, GREEDY)) == uncached[0]
    assert token_ids(run(engine, job, SEEDED)) == uncached[1]
    assert engine.kv_cache_manager.block_pool.num_evictions > 0


def test_cascade_attention_over_a_shared_preamble_changes_nothing(model_dir, job, monkeypatch, kv_cache_dtype):
    """All running lines share one preamble: with the cascade thresholds lowered, attention splits into the
    shared prefix (once per step) and each line's tail, and greedy and seeded outputs stay those of no cache."""
    lines = [line for line in job if line[0] == job[0][0]]
    plain = make_engine(model_dir, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    expected = token_ids(run(plain, lines, GREEDY)), token_ids(run(plain, lines, SEEDED))
    monkeypatch.setattr(cascade_attention, "MIN_SEQS", 2)
    monkeypatch.setattr(cascade_attention, "MIN_SHARED_TOKENS", BLOCK_SIZE)
    calls = []
    original = cascade_attention.prefix_attention
    monkeypatch.setattr(cascade_attention, "prefix_attention", lambda *args: calls.append(1) or original(*args))
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)

    assert token_ids(run(engine, lines, GREEDY)) == expected[0]
    assert token_ids(run(engine, lines, SEEDED)) == expected[1]
    assert len(lines) >= 4 and calls


def test_after_a_stop_string_inside_a_shared_block_later_prompts_are_unchanged(model_dir, job):
    """A line stops on a stop string mid-block; its generated tokens (also those past the stop) sit in
    cached blocks. Prompts continuing its prompt + output, or diverging inside that block, must be
    unaffected."""
    engine = make_engine(model_dir)
    plain = make_engine(model_dir, enable_prefix_caching=False)
    prompt = job[0]
    [full] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = full.outputs[0].text
    stop = next(text[i : i + 2] for i in range(8, len(text) - 1) if text.index(text[i : i + 2]) == i)
    [stopped] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop"
    generated = stopped.outputs[0].token_ids
    assert len(prompt) // BLOCK_SIZE < (len(prompt) + len(generated) - 1) // BLOCK_SIZE  # a full block holds output
    follow_ups = [
        prompt + generated,
        prompt + generated[:-1],
        prompt + generated[:3] + [3, 4, 5, 6, 7],  # diverges inside a block that holds generated tokens
        prompt + [3] + generated,
    ]
    cached = engine.generate(follow_ups, GREEDY)
    assert max(out.num_cached_tokens for out in cached) > len(prompt)  # hit blocks holding generated tokens
    assert token_ids(cached) == token_ids(plain.generate(follow_ups, GREEDY))


# ---------------------------------------------------------------- the real model (few-shot preamble)


@pytest.mark.slow
def test_few_shot_job_on_smollm2_matches_hugging_face_with_the_cache_cold_and_warm(served_model_dir, served_tokenizer):
    preamble = served_tokenizer.encode("".join(f"Q: What is {a} plus {a + 3}?\nA: {2 * a + 3}.\n" for a in range(12)))
    questions = ["What is 20 plus 23?", "What is 5 plus 8?", "Name a colour.", "What is 100 plus 103?"]
    prompts = [preamble + served_tokenizer.encode(f"Q: {q}\nA:") for q in questions]
    hf_model = transformers.LlamaForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()
    references = [hf_greedy_reference(hf_model, prompt, 12) for prompt in prompts]
    engine = LLMEngine(EngineConfig(model=str(served_model_dir), kv_cache_memory_bytes=64 << 20, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for label in ("cold", "warm"):
        outputs = run(engine, prompts, params)
        for i, (ref, out) in enumerate(zip(references, outputs)):
            assert_greedy_close(ref.token_ids, ref.top2, out.outputs[0].token_ids, label=f"{label} {i}")
    assert engine.make_stats().prefix_cache_hits >= 3 * (len(preamble) // 16 * 16)

"""Parallel sampling over copy-on-write forks on a tiny random Llama: one prefill per prompt, every branch
equal to a plain no-cache reference that samples it alone, reproducible whatever the batch and
preemption, and far fewer KV blocks than independent samples; greedy n > 1 and best_of."""

import random

import pytest
import torch

from tests.helpers.parity import assert_greedy_close, hf_greedy_reference
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sample.sampler import Sampler, make_sampling_key

SAMPLED = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    # 13 tokens: three full 4-token blocks and a partial one that every branch writes into first.
    return [[rng.randrange(3, 259) for _ in range(length)] for length in (13, 6, 21)]


def make_engine(model_dir, **overrides):
    fields = {"model": str(model_dir), "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 64}
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def run_checked(engine, prompts, params):
    """generate() by hand, checking invariants after every step; returns (outputs, peak blocks in use)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, request_params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(str(i), prompt, request_params)
    kv, schedule = engine.kv_cache_manager, engine.scheduler.schedule
    peak = 0

    def schedule_and_measure():  # blocks in use peak right after scheduling (finished ones free at step end)
        nonlocal peak
        out = schedule()
        peak = max(peak, engine.model_runner.num_blocks - kv.num_free_blocks)
        return out

    engine.scheduler.schedule = schedule_and_measure
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        kv.check_invariants()
    assert kv.num_free_blocks == engine.model_runner.num_blocks
    return [outputs[str(i)] for i in range(len(prompts))], peak


@torch.inference_mode()
def reference_sample(hf_model, prompt, params, sample_index):
    """Sample branch ``sample_index`` alone: full no-cache forward per token, the engine's sampler and key."""
    key = make_sampling_key(params.seed, sample_index, prompt)
    sampler, output = Sampler(), []
    for _ in range(params.max_tokens):
        logits = hf_model(torch.tensor([prompt + output])).logits[0, -1:].float()
        metadata = SamplingMetadata([params], [key], [prompt], [output], eos_token_id=None)
        output.append(sampler(logits, metadata).sampled_token_ids[0])
    return output


def samples(output):
    return [choice.token_ids for choice in output.outputs]


def test_forked_branches_prefill_once_and_each_equals_sampling_it_alone(model_dir, hf_model, prompts):
    engine = make_engine(model_dir)
    [out], _ = run_checked(engine, prompts[:1], SAMPLED)
    stats = engine.make_stats()
    assert stats.num_prompt_tokens_computed == len(prompts[0])  # the prompt was prefilled once
    assert stats.num_generation_tokens == 4 * SAMPLED.max_tokens
    assert [choice.index for choice in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples(out)}) > 1
    assert all(choice.finish_reason == "length" for choice in out.outputs)
    # A branch reading a stale or foreign copy of the shared partial block would sample differently.
    assert samples(out) == [reference_sample(hf_model, prompts[0], SAMPLED, k) for k in range(4)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_forked_samples_are_unchanged_by_rerun_neighbours_and_preemption(model_dir, prompts, kv_cache_dtype):
    dtype = {"kv_cache_dtype": kv_cache_dtype}
    [alone], _ = run_checked(make_engine(model_dir, **dtype), prompts[:1], SAMPLED)
    [again], _ = run_checked(make_engine(model_dir, **dtype), prompts[:1], SAMPLED)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    crowded, _ = run_checked(
        make_engine(model_dir, **dtype), [prompts[1], prompts[0], prompts[2]], [greedy, SAMPLED, SAMPLED]
    )
    # 12 blocks of 4 slots: the branches (23 tokens = 6 blocks each) cannot all stay resident.
    tight = make_engine(model_dir, num_gpu_blocks_override=12, max_model_len=32, **dtype)
    preempted, _ = run_checked(tight, [prompts[0], prompts[2]], SAMPLED)
    assert tight.make_stats().num_preemptions > 0
    assert samples(again) == samples(crowded[1]) == samples(preempted[0]) == samples(alone)


def test_forks_need_far_fewer_blocks_than_independent_samples(model_dir):
    prompt = list(range(3, 33))  # 30 tokens: 7 full blocks + 2 tokens
    n = 8
    forked = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    singles = [SamplingParams(temperature=1.0, seed=3 + k, max_tokens=4, ignore_eos=True) for k in range(n)]
    _, peak_forked = run_checked(make_engine(model_dir, enable_prefix_caching=False), [prompt], forked)
    _, peak_independent = run_checked(make_engine(model_dir, enable_prefix_caching=False), [prompt] * n, singles)
    assert peak_independent == n * 9  # 34 tokens each
    assert peak_forked <= 7 + n * 2  # the shared full blocks once, then each branch's own last blocks


def test_greedy_n_is_computed_once_and_replicated(model_dir, hf_model, prompts):
    engine = make_engine(model_dir)
    params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    [out], _ = run_checked(engine, prompts[:1], params)
    assert engine.make_stats().num_generation_tokens == 10
    assert [choice.index for choice in out.outputs] == [0, 1, 2]
    assert len({(tuple(c.token_ids), c.cumulative_logprob, c.text) for c in out.outputs}) == 1
    ref = hf_greedy_reference(hf_model, prompts[0], 10)
    assert_greedy_close(ref.token_ids, ref.top2, out.outputs[0].token_ids)


def test_each_branch_has_its_own_stop_and_finish_reason(model_dir, prompts):
    stop_ids = list(range(3, 200))  # most of the vocabulary: branches stop early, at different steps
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=8, stop_token_ids=stop_ids, min_tokens=1)
    [out], _ = run_checked(make_engine(model_dir), prompts[:1], params)
    for choice in out.outputs:
        if choice.finish_reason == "stop":
            assert choice.token_ids[-1] in stop_ids and choice.stop_reason == choice.token_ids[-1]
            assert all(t not in stop_ids for t in choice.token_ids[1:-1])
        else:
            assert choice.finish_reason == "length" and len(choice.token_ids) == 8
    assert len({len(choice.token_ids) for choice in out.outputs}) > 1


def test_best_of_returns_the_n_branches_with_the_highest_cumulative_logprob(model_dir, prompts):
    all_six = SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    best_two = SamplingParams(n=2, best_of=6, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    [everything], _ = run_checked(make_engine(model_dir), prompts[:1], all_six)
    [best], _ = run_checked(make_engine(model_dir), prompts[:1], best_two)
    ranked = sorted(everything.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_best_of_without_logprobs_still_ranks_and_reports_none(model_dir, prompts):
    params = SamplingParams(n=1, best_of=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    [out], _ = run_checked(make_engine(model_dir), prompts[:1], params)
    ranked = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    [everything], _ = run_checked(make_engine(model_dir), prompts[:1], ranked)
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None
    assert out.outputs[0].token_ids == max(everything.outputs, key=lambda c: c.cumulative_logprob).token_ids


def test_best_of_below_n_is_rejected():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_abort_before_the_fork_frees_everything(model_dir, prompts):
    engine = make_engine(model_dir, max_num_batched_tokens=4)  # the 13-token prompt takes four steps
    engine.add_request("r", prompts[0], SAMPLED)
    engine.step()
    engine.abort_request("r")
    engine.kv_cache_manager.check_invariants()
    assert not engine.scheduler.has_unfinished_seqs()
    assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_disabled_forks_sample_the_same_tokens_with_every_branch_its_own_blocks(model_dir, prompts, kv_cache_dtype):
    """``enable_forks=False`` (bench/forks.py's baseline): each branch prefills on its own, the prefix cache
    (on here) does not share the prompt between branches either, and the seeded samples are unchanged. On the
    int8 cache too: a copy-on-write copy that lost its scales would part the forked branches from the copied."""
    forked_engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    copied_engine = make_engine(model_dir, enable_forks=False, kv_cache_dtype=kv_cache_dtype)
    [forked], peak_forked = run_checked(forked_engine, prompts[:1], SAMPLED)
    [copied], peak_copied = run_checked(copied_engine, prompts[:1], SAMPLED)
    forked_stats, copied_stats = forked_engine.make_stats(), copied_engine.make_stats()
    assert samples(copied) == samples(forked)
    assert copied_stats.num_prompt_tokens_computed == 4 * len(prompts[0])
    assert copied_stats.prefix_cache_hits == 0
    # 13 + 10 tokens, the last never written: 22 slots = 6 blocks per branch, none shared.
    assert peak_copied == 4 * 6
    # The 3 full prompt blocks once, then each branch's copy of the partial one and its own 2 more.
    assert peak_forked == 3 + 4 * 3
    assert (forked_stats.num_kv_blocks_peak, copied_stats.num_kv_blocks_peak) == (peak_forked, peak_copied)

"""Speculative decoding end to end on a tiny random Llama (docs/engine.md, "Speculative decoding").

Greedy lines give the same completions with and without speculation (ids, text, finish and stop
reasons, logprobs, token counts), whatever per-token rule ends them inside an accepted run; sampled lines
keep the target distribution (two-sample chi-square over many seeded lines, both proposers); the
bookkeeping holds after every step and every block (target and draft cache) is free at the end.
"""

import pytest
import torch

from tests.helpers.tiny_llama import save_tiny_llama
from tests.worker.engine.spec_decode.stats_helpers import chi_square_p_value
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.spec_decode.proposer import DraftProposal, Proposer

REPEAT = [10] * 30  # the tiny model continues it with long runs of one token
CYCLE = [5, 6, 7, 8, 9] * 3 + [5, 6]
VARIED = list(range(3, 40))
KS = [61] * 8  # continued as "kkkk...k!k!" by the tiny model
PROMPTS = [REPEAT, CYCLE, VARIED]
METHODS = {
    "ngram": dict(speculative_method="ngram"),
    "ngram-tree": dict(speculative_method="ngram", speculative_tree_width=3),
    "self-draft-all-layers": dict(speculative_method="draft", speculative_draft_num_layers=2),
    "self-draft-1-layer": dict(speculative_method="draft", speculative_draft_num_layers=1),
}


def make_engine(model_dir, mode="on", **overrides):
    fields = dict(model=str(model_dir), kv_cache_memory_bytes=8 << 20, speculative_mode=mode)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def run_checked(engine, prompts, params):
    """generate(), but checking the invariants after every step; all blocks must be free at the end."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, p)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        engine.kv_cache_manager.check_invariants()
        for seq in engine.scheduler.running:
            assert not seq.spec_token_ids
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    if hasattr(proposer, "num_free_blocks"):
        assert proposer.num_free_blocks == engine.model_runner.num_blocks
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def assert_same_completion(expected, got, logprob_tol=1e-4):
    for a, b in zip(expected.outputs, got.outputs, strict=True):
        assert b.token_ids == a.token_ids
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        for pos_a, pos_b in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert pos_a.keys() == pos_b.keys()
            for token_id in pos_a:
                assert pos_b[token_id].logprob == pytest.approx(pos_a[token_id].logprob, abs=logprob_tol)


def assert_alone_and_batched_match_plain(engine, plain, prompts, params):
    """``engine`` completes ``prompts`` alone and all at once exactly as ``plain`` does each alone; returns
    ``plain``'s completions."""
    expected = [plain.generate([prompt], params)[0] for prompt in prompts]
    alone = [run_checked(engine, [prompt], params)[0] for prompt in prompts]
    batched = run_checked(engine, prompts, params)
    for ref, one, many in zip(expected, alone, batched, strict=True):
        assert_same_completion(ref, one)
        assert_same_completion(ref, many)
    return expected


@pytest.fixture(scope="module")
def plain(model_dir):
    return make_engine(model_dir, mode="off")


@pytest.mark.parametrize("method", METHODS)
def test_greedy_ids_identical_alone_and_batched(model_dir, plain, method):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    engine = make_engine(model_dir, **METHODS[method])
    expected = assert_alone_and_batched_match_plain(engine, plain, PROMPTS, params)
    stats = engine.make_stats()
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 1.0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    # Every output token was generated once: usage agrees with the plain run.
    assert stats.num_generation_tokens == 2 * sum(len(out.outputs[0].token_ids) for out in expected)


def _dropped_in_run(engine):
    """Tokens a verification produced after the finishing one (one request, prompt in one step): > 0 means
    the finish landed inside an accepted run. Tokens produced = one per step + the accepted drafts."""
    stats = engine.make_stats()
    return stats.num_steps + stats.num_accepted_tokens - stats.num_generation_tokens


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "self-draft-all-layers"])
def test_per_token_rules_truncate_inside_accepted_runs(model_dir, plain, method):
    """Stop ids, stop strings (with min_tokens holding them back) and max_tokens on prompts the tiny model
    continues with long runs of one token, so drafts are accepted in runs and a stop lands inside one."""
    engine = make_engine(model_dir, **METHODS[method])
    base = dict(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    cases = []
    for j in (5, 8, 12, 15):
        cases.append((REPEAT, dict(stop_token_ids=[136], min_tokens=j)))  # 136 is every early token
        cases.append((KS, dict(stop=["kkk"], min_tokens=j)))
        cases.append((KS, dict(stop=["kk"], min_tokens=j, include_stop_str_in_output=True)))
    cases.append((REPEAT, dict(stop_token_ids=[217])))
    cases.append((REPEAT, dict(stop_token_ids=[217], include_stop_str_in_output=True)))
    cases.append((KS, dict(stop=["k!"])))
    for max_tokens in (5, 11, 23):
        cases.append((REPEAT, dict(max_tokens=max_tokens)))
    dropped = 0
    for prompt, case in cases:
        params = SamplingParams(**{**base, **case})
        expected = plain.generate([prompt], params)[0]
        engine.make_stats()
        got = run_checked(engine, [prompt], params)[0]
        assert_same_completion(expected, got)
        assert expected.outputs[0].finish_reason == ("length" if "max_tokens" in case else "stop")
        dropped += _dropped_in_run(engine)
    assert dropped > 0, "no case finished inside an accepted run"


def test_eos_inside_an_accepted_run(tmp_path_factory):
    """EOS (and min_tokens holding it back) in the middle of a run of accepted drafts: a model that
    repeats a cycle containing EOS."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny_eos"), seed=0)
    plain = make_engine(model_dir, mode="off")
    engine = make_engine(model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Find a prompt whose greedy continuation holds some token late enough; call it EOS via stop ids.
    prompt = CYCLE
    ids = plain.generate([prompt], greedy)[0].outputs[0].token_ids
    for min_tokens in (0, 4, 9):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[8]], min_tokens=min_tokens)
        assert_same_completion(plain.generate([prompt], params)[0], run_checked(engine, [prompt], params)[0])
    # The real EOS id: a prompt that ends in EOS cycles (the n-gram drafts EOS after its context).
    eos_prompt = [5, 6, 2, 5, 6, 2, 5, 6, 2, 5, 6]
    for min_tokens in (0, 3):
        params = SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens)
        assert_same_completion(plain.generate([eos_prompt], params)[0], run_checked(engine, [eos_prompt], params)[0])


@pytest.mark.parametrize("method", ["ngram", "self-draft-1-layer"])
def test_penalties_and_logit_bias_apply_at_every_verified_position(model_dir, plain, method):
    engine = make_engine(model_dir, **METHODS[method])
    for extra in (
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.4, presence_penalty=0.3),
        dict(logit_bias={136: -2.0, 217: 3.0}),
    ):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **extra)
        for prompt in (REPEAT, CYCLE):
            assert_same_completion(plain.generate([prompt], params)[0], run_checked(engine, [prompt], params)[0])


@pytest.mark.parametrize(
    ("method", "kv_cache_dtype"),
    [
        ("ngram", "auto"),
        ("self-draft-all-layers", "auto"),
        ("ngram", "int8"),
        ("ngram-tree", "auto"),
        ("ngram-tree", "int8"),
    ],
)
def test_greedy_unchanged_in_a_batch_mixing_sampled_lines_and_under_preemption(
    model_dir, plain, method, kv_cache_dtype
):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, max_tokens=48, ignore_eos=True, seed=s) for s in range(3)]
    sampled.append(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=48, ignore_eos=True, n=2))
    prompts = PROMPTS + [VARIED[5:], CYCLE[2:], REPEAT[:20], VARIED[:9]]
    params = [greedy] * 3 + sampled
    if kv_cache_dtype != "auto":
        plain = make_engine(model_dir, mode="off", kv_cache_dtype=kv_cache_dtype)
    expected = [plain.generate([prompt], greedy)[0] for prompt in PROMPTS]
    # 14 blocks of 8 tokens cannot hold every line: the youngest are preempted and recomputed.
    small = dict(num_gpu_blocks_override=14, max_model_len=96)
    options = {**METHODS[method], "kv_cache_dtype": kv_cache_dtype}
    for engine in (make_engine(model_dir, **options), make_engine(model_dir, **options, **small)):
        outputs = run_checked(engine, prompts, params)
        for ref, out in zip(expected, outputs[:3]):
            assert_same_completion(ref, out)
        assert all(len(c.token_ids) == 48 for out in outputs for c in out.outputs)
        stats = engine.make_stats()
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_preemptions > 0


def test_auto_policy_stays_off_for_large_batches_and_seeded_lines(model_dir):
    engine = make_engine(model_dir, mode="auto", speculative_disable_by_batch_size=2)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate([REPEAT, CYCLE, VARIED], greedy)
    assert engine.make_stats().num_drafts == 0  # three running lines: above the threshold
    engine.generate([REPEAT], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1))
    assert engine.make_stats().num_drafts == 0  # a seeded line keeps its reproducible stream
    engine.generate([REPEAT], greedy)
    assert engine.make_stats().num_drafts > 0


def _distribution_samples(model_dir, mode, method, num_lines, prompt):
    engine = make_engine(model_dir, mode=mode, speculative_disable_by_batch_size=num_lines, **METHODS[method])
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=3, ignore_eos=True, seed=seed)
        for seed in range(num_lines)
    ]
    outputs = engine.generate([prompt] * num_lines, params)
    stats = engine.make_stats()
    return [tuple(out.outputs[0].token_ids) for out in outputs], stats


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "self-draft-1-layer"])
def test_sampling_preserves_the_target_distribution(tmp_path_factory, method):
    """Many seeded lines of 3 tokens on a 12-token vocabulary: the joint distribution of the 3 tokens with
    speculation cannot be told apart from plain sampling's (chi-square, p > 1e-3)."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny_vocab12"), seed=1, vocab_size=12)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 6, 7, 3, 4]
    torch.manual_seed(0)
    num_lines = 2000
    speculative, stats = _distribution_samples(model_dir, "on", method, num_lines, prompt)
    plain, _ = _distribution_samples(model_dir, "off", method, num_lines, prompt)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes were exercised
    assert chi_square_p_value(speculative, plain) > 1e-3
    assert chi_square_p_value([s[1:] for s in speculative], [s[1:] for s in plain]) > 1e-3


# Prompts whose last two tokens were followed by four different tokens earlier: the n-gram proposer drafts trees,
# and the tiny model accepts paths off the latest continuation (so accepted K/V are moved).
BRANCHY = [
    [18, 22, 49, 28, 18, 22, 33, 12, 18, 22, 8, 7, 18, 22, 4, 28, 18, 22],
    [23, 12, 44, 6, 23, 12, 7, 55, 23, 12, 37, 9, 23, 12, 26, 40, 23, 12],
]


def _count_moved_paths(engine):
    """Wrap the model runner so that it counts verified trees and those whose accepted path left the first
    branch (K/V moved to consecutive slots)."""
    counts = {"trees": 0, "moved": 0}
    keep = engine.model_runner._keep_accepted_paths

    def counting(seqs, block_ids, verified_seqs, verified):
        for seq, result in zip(verified_seqs, verified):
            if seq.spec_parent_idx is not None:
                counts["trees"] += 1
                counts["moved"] += result.accepted_nodes != list(range(result.num_accepted_tokens))
        keep(seqs, block_ids, verified_seqs, verified)

    engine.model_runner._keep_accepted_paths = counting
    return counts


def test_tree_verification_is_plain_decoding_with_prefix_caching(model_dir, plain):
    """Greedy lines with draft trees: the same completions alone and batched; then prompts that extend them hit
    the prefix cache on blocks written by tree steps (moved K/V included) and still match a plain engine, which
    computes those positions afresh: the moved cache is what plain decoding writes."""
    engine = make_engine(model_dir, **METHODS["ngram-tree"])
    counts = _count_moved_paths(engine)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    expected = assert_alone_and_batched_match_plain(engine, plain, BRANCHY, params)
    assert counts["trees"] > 0 and counts["moved"] > 0
    extended = [prompt + ref.outputs[0].token_ids[:30] for prompt, ref in zip(BRANCHY, expected)]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    engine.make_stats()
    got = run_checked(engine, extended, short)
    assert engine.make_stats().num_cached_tokens >= 2 * 40  # blocks of the tree-decoded outputs were reused
    for prompt, out in zip(extended, got):
        ref = plain.generate([prompt], short)[0]
        assert_same_completion(ref, out)


class OracleTreeProposer(Proposer):
    """A test drafter that knows the plain run's tokens: a tree whose first branch is wrong (the next token + 1) and
    whose second branch is the plain continuation, with a wrong leaf under its first node; every accepted path
    then leaves the first branch and its K/V must move."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]]) -> None:
        self.expected = expected

    def propose(self, seqs, num_spec_tokens):
        proposals = []
        for seq, k in zip(seqs, num_spec_tokens):
            future = self.expected[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :][:k]
            if not future:
                proposals.append(DraftProposal([]))
                continue
            wrong = [(future[0] + 1) % 64, 3]
            # nodes: 0-1 the wrong branch, 2.. the right one, then a wrong sibling under node 2
            parents = [-1, 0, -1] + list(range(2, 2 + len(future) - 1)) + [2]
            proposals.append(DraftProposal(wrong + future + [(future[1 % len(future)] + 1) % 64], parent_idx=parents))
        return proposals


def test_tree_paths_with_stops_and_max_tokens(model_dir, plain):
    """Stop ids, stop strings and max_tokens landing inside accepted tree paths (off the first branch, so the
    path's K/V were moved) end the line exactly there, with the plain run's ids, text and logprobs."""
    engine = make_engine(model_dir, **METHODS["ngram-tree"])
    counts = _count_moved_paths(engine)
    base = dict(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    expected = {tuple(p): plain.generate([p], SamplingParams(**base))[0].outputs[0].token_ids for p in BRANCHY}
    engine.speculator.proposer = OracleTreeProposer(expected)
    dropped = 0
    for prompt in BRANCHY:
        ids = expected[tuple(prompt)]
        text = plain.generate([prompt], SamplingParams(**base))[0].outputs[0].text
        cases = [dict(max_tokens=m) for m in (3, 7, 13, 22)]
        cases += [dict(stop_token_ids=[ids[j]], min_tokens=j) for j in (4, 9, 17, 26)]
        cases += [dict(stop=[text[len(text) // 2 : len(text) // 2 + 3]])]
        for case in cases:
            params = SamplingParams(**{**base, **case})
            engine.make_stats()
            assert_same_completion(plain.generate([prompt], params)[0], run_checked(engine, [prompt], params)[0])
            dropped += _dropped_in_run(engine)
    assert dropped > 0 and counts["moved"] > 0

"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy ids as without speculation (near-tie rule),
for n-gram prompt lookup and the self-speculative draft (docs/engine.md, "Speculative decoding").

Few prompts on purpose (CI has 2 cores). The reference is the same engine without speculation, with its
top-two logprobs per position for the near-tie rule.
"""

import pytest

from tests.helpers.parity import TopTwo, assert_greedy_close, chat_prompt_ids
from worker.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
QUESTIONS = ["What is the capital of France?", "def fibonacci(n):"]
COPY_TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
METHODS = {
    "ngram": dict(speculative_method="ngram"),
    "self-draft": dict(speculative_method="draft", speculative_draft_num_layers=8),
}


def make_engine(model_dir, mode, **overrides):
    fields = dict(model=str(model_dir), kv_cache_memory_bytes=64 << 20, max_model_len=512, speculative_mode=mode)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


@pytest.fixture(scope="module")
def prompts(served_tokenizer):
    chat = chat_prompt_ids(served_tokenizer, QUESTIONS + [f"Repeat this sentence exactly: {COPY_TEXT}"])
    return chat + [served_tokenizer.encode(" ".join(["hello"] * 50))]


@pytest.fixture(scope="module")
def plain(served_model_dir):
    return make_engine(served_model_dir, "off")


@pytest.fixture(scope="module")
def references(plain, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return [plain.generate([prompt], params)[0].outputs[0] for prompt in prompts]


def _top2(completion):
    top2 = []
    for entry in completion.logprobs:
        (id1, lp1), (id2, lp2) = sorted(((i, lp.logprob) for i, lp in entry.items()), key=lambda x: -x[1])[:2]
        top2.append(TopTwo(lp1, lp2, id1, id2))
    return top2


@pytest.mark.parametrize("method", METHODS)
def test_greedy_alone_batched_and_mixed_with_sampled_lines(served_model_dir, prompts, references, method):
    engine = make_engine(served_model_dir, "on", **METHODS[method])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [engine.generate([prompt], greedy)[0] for prompt in prompts]
    sampled = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    mixed = engine.generate(prompts + prompts[:2], [greedy] * len(prompts) + [sampled] * 2)
    for i, ref in enumerate(references):
        assert_greedy_close(ref.token_ids, _top2(ref), alone[i].outputs[0].token_ids, label=f"{method} alone {i}")
        assert_greedy_close(ref.token_ids, _top2(ref), mixed[i].outputs[0].token_ids, label=f"{method} mixed {i}")
    stats = engine.make_stats()
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_stops_inside_accepted_runs_give_the_plain_completion(served_model_dir, prompts, plain, method):
    """On the copy prompt (long accepted runs) and the repeated word: stop strings, stop ids, EOS and
    max_tokens chosen from the plain output so they fall inside runs; the whole completion agrees."""
    engine = make_engine(served_model_dir, "on", **METHODS[method])
    tokenizer = plain.tokenizer
    base = dict(temperature=0, max_tokens=40, logprobs=2)  # two alternatives: the near-tie rule needs them
    cases = []
    for prompt in prompts[2:]:
        ids = plain.generate([prompt], SamplingParams(**base, ignore_eos=True))[0].outputs[0].token_ids
        for j in (7, 13, 22):
            cases.append((prompt, dict(stop_token_ids=[ids[j]], min_tokens=j, ignore_eos=True)))
            words = tokenizer.decode(ids[: j + 1]).split()
            if words:
                cases.append((prompt, dict(stop=[words[-1]], min_tokens=j)))
        cases.append((prompt, dict(max_tokens=19, ignore_eos=True)))
        cases.append((prompt, dict(max_tokens=40)))  # EOS where the model ends its answer
    for prompt, case in cases:
        params = SamplingParams(**{**base, **case})
        expected = plain.generate([prompt], params)[0].outputs[0]
        got = engine.generate([prompt], params)[0].outputs[0]
        label = f"{method} {case}"
        assert_greedy_close(expected.token_ids, _top2(expected), got.token_ids, label=label)
        if got.token_ids == expected.token_ids:
            assert (got.text, got.finish_reason, got.stop_reason) == (
                expected.text,
                expected.finish_reason,
                expected.stop_reason,
            ), label
            for a, b in zip(expected.logprobs, got.logprobs, strict=True):
                for token_id in a:
                    assert b[token_id].logprob == pytest.approx(a[token_id].logprob, abs=1e-3), label
    stats = engine.make_stats()
    assert stats.num_accepted_tokens > 0

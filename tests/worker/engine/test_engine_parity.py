"""The engine on the real SmolLM2-135M-Instruct against Hugging Face ``generate`` (near-tie rule).

Few tests on purpose (CI has 2 cores): the HF references for 8 chat prompts x 32 tokens are computed
once; every engine configuration (alone, batched, 64 mixed requests, chunked, preempting) must
reproduce them.
"""

import pytest
import torch
import transformers

from tests.helpers.parity import assert_greedy_close, chat_prompt_ids, hf_greedy_reference
from worker.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers.",
    "Hi",
    "Translate 'good morning' into Spanish and German, and say which language is more widely spoken.",
    "def fibonacci(n):",
    "Why is the sky blue? Answer briefly, for a child of seven who asked at breakfast.",
]


@pytest.fixture(scope="module")
def prompts(served_tokenizer):
    return chat_prompt_ids(served_tokenizer, QUESTIONS)


@pytest.fixture(scope="module")
def references(served_model_dir, prompts):
    hf_model = transformers.LlamaForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()
    return [hf_greedy_reference(hf_model, prompt, MAX_TOKENS) for prompt in prompts]


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), kv_cache_memory_bytes=64 << 20, max_model_len=512)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def assert_all_close(references, outputs, label):
    for i, (ref, out) in enumerate(zip(references, outputs)):
        num_tokens = len(out.outputs[0].token_ids)
        assert_greedy_close(ref.token_ids[:num_tokens], ref.top2, out.outputs[0].token_ids, label=f"{label} {i}")


def test_alone_and_batched_match_hugging_face(served_model_dir, prompts, references):
    engine = make_engine(served_model_dir)
    alone = [engine.generate([prompt], GREEDY)[0] for prompt in prompts]
    assert_all_close(references, alone, "alone")
    batched = engine.generate(prompts, GREEDY)
    assert_all_close(references, batched, "batched")
    assert all(len(out.outputs[0].token_ids) == MAX_TOKENS for out in alone + batched)
    assert engine.make_stats().num_cached_tokens > 0  # the second pass hit the prefix cache


def test_batch_of_64_with_mixed_prompt_and_output_lengths(served_model_dir, prompts, references):
    engine = make_engine(served_model_dir, enable_prefix_caching=False)
    # 8 prompts of 9..40 tokens, each with 8 output lengths: a greedy output is a prefix of the reference.
    lengths = [4, 32, 9, 27, 14, 1, 20, 32]
    requests = [(i, lengths[(i + j) % 8]) for j in range(8) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    outputs = engine.generate([prompts[i] for i, _ in requests], params)
    for (_, max_tokens), out in zip(requests, outputs):
        assert len(out.outputs[0].token_ids) == max_tokens
    assert_all_close([references[i] for i, _ in requests], outputs, "mixed")


def test_chunked_prefill_matches_hugging_face(served_model_dir, prompts, references):
    engine = make_engine(served_model_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert_all_close(references, engine.generate(prompts, GREEDY), "chunked")


def test_preemption_matches_hugging_face(served_model_dir, prompts, references):
    # 8 sequences of up to 72 tokens need ~72 blocks of 8; 24 blocks force recompute preemption.
    engine = make_engine(served_model_dir, block_size=8, num_gpu_blocks_override=24, max_model_len=192)
    outputs = engine.generate(prompts, GREEDY)
    assert engine.make_stats().num_preemptions > 0
    assert_all_close(references, outputs, "preempted")

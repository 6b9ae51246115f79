"""Seeded lines on the real model give bit-identical token ids and logprobs however they are batched:
alone, with their own prefill chunked, next to neighbours whose prefill is chunked, and after their own
preemption (docs/engine.md, "Batch-invariant numerics"); and lines sharing one seed draw independently.
In a bfloat16 engine over q4 weights (q4-bf16), whose linear layers run other numerics above 24 rows unless the
step holds a seeded line, two identical seeded lines submitted together, and a seeded line alone or in a tall batch,
agree bit for bit."""

import pytest
import torch

from kernels.cpu_extension import cpu_flags, cpu_kernels_available
from tests.helpers.parity import chat_prompt_ids
from worker.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a short story about a dragon who learns to program in Python, with a twist at the end. " * 2,
    "def add(a, b):",
    "Explain what a hash table is, how collisions are handled, and when you would not use one.",
    "List ten fruits and their colours.",
    "Hi",
]
TARGETS = {  # request id -> params; the seeds differ so the two targets share nothing but the system prompt
    "n1": SamplingParams(n=1, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
    "n4": SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True, logprobs=0),
}
NEIGHBOUR = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)  # unseeded: the fast paths


@pytest.fixture(scope="module")
def prompts(served_tokenizer):
    return chat_prompt_ids(served_tokenizer, QUESTIONS)


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), kv_cache_memory_bytes=64 << 20, max_model_len=256)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def run(engine, requests):
    """Add ``(request_id, prompt, params)`` in order, step to the end; the targets' choices as
    ``{request_id: [(token_ids, logprobs, cumulative_logprob)]}`` and the request ids that were preempted."""
    preempted: set[str] = set()
    schedule = engine.scheduler.schedule

    def schedule_and_record():
        out = schedule()
        preempted.update(rid for rid, params in TARGETS.items() for seq in out.preempted_seqs if seq.params is params)
        return out

    engine.scheduler.schedule = schedule_and_record
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id in TARGETS:
                results[output.request_id] = [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in output.outputs]
    engine.kv_cache_manager.check_invariants()
    return results, preempted


@torch.inference_mode()
def test_seeded_lines_are_bit_identical_however_they_are_batched(served_model_dir, prompts):
    target_prompt = prompts[0]  # 73 tokens: chunked under a 64-token budget
    alone = {rid: run(make_engine(served_model_dir), [(rid, target_prompt, p)])[0][rid] for rid, p in TARGETS.items()}
    n4 = alone["n4"]
    assert len(n4) == 4 and len({tuple(ids) for ids, _, _ in n4}) > 1  # 4 distinct-enough choices

    targets = [(rid, target_prompt, TARGETS[rid]) for rid in ("n4", "n1")]
    neighbours = [(f"neighbour-{i}", prompt, NEIGHBOUR) for i, prompt in enumerate(prompts[1:] + prompts[:1])]

    rerun, _ = run(make_engine(served_model_dir), targets)
    own_chunked, _ = run(make_engine(served_model_dir, max_num_batched_tokens=64), targets)
    # The neighbours come first: their prefill is chunked and shares the targets' steps and system prompt.
    crowded, _ = run(make_engine(served_model_dir, max_num_batched_tokens=64), neighbours + targets)
    # 14 blocks of 16 slots for 10 sequences of up to 90 tokens: the youngest (the targets) are preempted.
    tight = make_engine(served_model_dir, num_gpu_blocks_override=14, block_size=16, max_model_len=128)
    after_preemption, preempted = run(tight, neighbours + targets)
    assert preempted == set(TARGETS), preempted

    for label, result in [
        ("rerun", rerun),
        ("own chunked", own_chunked),
        ("crowded", crowded),
        ("preempted", after_preemption),
    ]:
        for rid in TARGETS:
            assert result[rid] == alone[rid], f"{label}: {rid} differs from the line alone"


SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True, logprobs=2)


def q4_bf16_engine(model_dir):
    """A bfloat16 engine over the served model's Q4 GGUF blocks, prefix caching on; skips where q4-bf16 cannot run."""
    if not cpu_kernels_available() or "avx512_bf16" not in cpu_flags():
        pytest.skip("q4-bf16 needs the C++ kernels and a CPU with AVX512_BF16")
    return make_engine(
        model_dir,
        dtype="bfloat16",
        quantization="q4",
        enable_prefix_caching=True,
        kv_cache_memory_bytes=192 << 20,
        max_model_len=512,
    )


def seeded_choices(engine, requests):
    """Add ``(request_id, prompt, params)`` in order, step to the end; ``{request_id: (token_ids, logprobs,
    cumulative_logprob)}`` of the seeded requests' single choices."""
    seeded = {request_id for request_id, _, params in requests if params.seed is not None}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id in seeded:
                choice = output.outputs[0]
                results[output.request_id] = (choice.token_ids, choice.logprobs, choice.cumulative_logprob)
    return results


@torch.inference_mode()
def test_q4_bf16_identical_seeded_lines_submitted_together_agree(served_model_dir, prompts):
    # The first prefills the whole prompt (a tall step); the second then computes its last token over the first's
    # cached blocks (a short step): the same bits only if both steps run one numerics.
    engine = q4_bf16_engine(served_model_dir)
    assert len(prompts[2]) > 24
    results = seeded_choices(engine, [("first", prompts[2], SEEDED), ("second", prompts[2], SEEDED)])

    assert engine.make_stats().num_cached_tokens > 0  # the second line did start from the first's blocks
    assert len(results["first"][0]) == 24
    assert results["second"] == results["first"]


@torch.inference_mode()
def test_q4_bf16_seeded_line_alone_and_among_thirty_long_neighbours_agree(served_model_dir, served_tokenizer, prompts):
    # Among 30 unseeded neighbours every decode step has 31 rows (above the kernel's 24-row exact range).
    alone = seeded_choices(q4_bf16_engine(served_model_dir), [("target", prompts[2], SEEDED)])
    questions = [f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]} Answer at length." for i in range(30)]
    neighbour = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True)
    neighbours = [(f"neighbour-{i}", p, neighbour) for i, p in enumerate(chat_prompt_ids(served_tokenizer, questions))]

    crowded = seeded_choices(q4_bf16_engine(served_model_dir), [*neighbours, ("target", prompts[2], SEEDED)])

    assert crowded["target"] == alone["target"]

"""Resuming a request from its generated tokens (docs/engine.md, "Resuming a request"): a greedy or seeded
request interrupted after k tokens and added again with them (to the same engine or a fresh one) ends
exactly as its uninterrupted run: tokens, text, finish and stop reason; stop strings across the resume
point, penalties, ``min_tokens`` and ``max_tokens`` included. Requests that cannot resume are refused."""

import dataclasses
import random

import pytest

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.core.request import can_resume
from worker.engine.errors import ResumeError


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 259) for _ in range(length)] for length in (5, 11, 23)]


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), block_size=4, kv_cache_memory_bytes=1 << 22, max_model_len=96)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def finish(engine, request_id):
    while True:
        for output in engine.step():
            if output.request_id == request_id:
                return output


def interrupt(engine, request_id, prompt, params, at):
    """Run the request until it has at least ``at`` output tokens; abort it there; its tokens so far."""
    engine.add_request(request_id, prompt, params)
    while (progress := engine.progress()[request_id]).num_generated_tokens < at:
        assert not [o for o in engine.step() if o.request_id == request_id], "finished before the interruption"
    engine.abort_request(request_id)
    assert progress.resumable_token_ids is not None
    assert len(progress.resumable_token_ids) == progress.num_generated_tokens
    return progress.resumable_token_ids


def summary(output):
    (choice,) = output.outputs
    return choice.token_ids, choice.text, choice.finish_reason, choice.stop_reason, output.prompt_token_ids


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=40, ignore_eos=True),
    "seeded with penalties": SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=40,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        ignore_eos=True,
    ),
    "greedy with penalties": SamplingParams(
        temperature=0, max_tokens=40, frequency_penalty=1.0, repetition_penalty=1.2, ignore_eos=True
    ),
    # min_tokens masks EOS up to token 30: the resumed run must count the earlier tokens toward it.
    "seeded min_tokens": SamplingParams(temperature=1.0, seed=5, min_tokens=30, max_tokens=60),
}


# Where the request resumes: the engine it ran in (its blocks may still be cached), a fresh engine (another
# worker), one whose token budget chunks the recompute.
TARGETS = {"same engine": None, "fresh engine": {}, "chunked recompute": {"max_num_batched_tokens": 8}}
SPECULATING = {"speculative_mode": "on", "speculative_method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("where", TARGETS)
def test_a_resumed_request_ends_as_the_uninterrupted_run(model_dir, engine, prompts, case, where):
    params = CASES[case]
    overrides = TARGETS[where]
    for index, prompt in enumerate(prompts):
        (reference,) = engine.generate([prompt], params)
        token_ids = interrupt(engine, f"{case}-{index}-cut", prompt, params, at=17)
        assert token_ids == reference.outputs[0].token_ids[: len(token_ids)]

        target = engine if overrides is None else make_engine(model_dir, **overrides)
        target.add_request(f"{case}-{index}", prompt, params, resumed_token_ids=token_ids)
        resumed = finish(target, f"{case}-{index}")

        assert summary(resumed) == summary(reference), f"prompt {index}"
        assert resumed.num_cached_tokens <= len(prompt)
        target.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("case", [case for case, params in CASES.items() if params.is_greedy])
def test_a_greedy_request_resumes_exactly_in_a_speculating_engine(model_dir, prompts, case):
    """Drafts verified by argmax keep greedy output as it was, wherever the drafts of the resumed run start.
    (Forced speculation of a seeded line is not exact across a resume: its rejection-sampling draws depend on
    where each draft begins; ``auto`` never speculates seeded lines.)"""
    engine = make_engine(model_dir, **SPECULATING)
    params = CASES[case]
    for index, prompt in enumerate(prompts):
        (reference,) = engine.generate([prompt], params)
        token_ids = interrupt(engine, f"cut-{index}", prompt, params, at=17)
        engine.add_request(f"resumed-{index}", prompt, params, resumed_token_ids=token_ids)
        assert summary(finish(engine, f"resumed-{index}")) == summary(reference), f"prompt {index}"
    assert engine.make_stats().num_draft_tokens > 0


def test_max_tokens_counts_the_resumed_tokens(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    token_ids = interrupt(engine, "cut", prompts[0], params, at=24)
    engine.add_request("max", prompts[0], params, resumed_token_ids=token_ids)
    output = finish(engine, "max")
    assert len(output.outputs[0].token_ids) == 25 and output.outputs[0].finish_reason == "length"


def test_a_stop_string_across_the_resume_point_is_found(engine, prompts):
    letters = engine.tokenizer.convert_tokens_to_ids(list("abcdefgh"))
    free = SamplingParams(
        temperature=1.0, seed=9, max_tokens=40, ignore_eos=True, logit_bias=dict.fromkeys(letters, 10.0)
    )
    (reference,) = engine.generate([prompts[1]], free)
    text = reference.outputs[0].text
    # Output characters 15..18 (one letter per token): the interruption at 17 splits the stop string.
    stop = text[15:19]
    assert len(text) == 40 and text.find(stop) == 15, text
    params = dataclasses.replace(free, stop=[stop])
    (stopped,) = engine.generate([prompts[1]], params)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == text[:15]

    token_ids = interrupt(engine, "cut", prompts[1], params, at=17)
    assert len(token_ids) == 17
    engine.add_request("stop", prompts[1], params, resumed_token_ids=token_ids)
    assert summary(finish(engine, "stop")) == summary(stopped)


def test_an_interrupted_request_resumes_twice(engine, prompts):
    params = CASES["seeded with penalties"]
    (reference,) = engine.generate([prompts[2]], params)
    first = interrupt(engine, "cut-1", prompts[2], params, at=9)
    engine.add_request("cut-2", prompts[2], params, resumed_token_ids=first)
    while (progress := engine.progress()["cut-2"]).num_generated_tokens < 26:
        engine.step()
    engine.abort_request("cut-2")
    assert progress.resumable_token_ids is not None and len(progress.resumable_token_ids) >= 26

    engine.add_request("again", prompts[2], params, resumed_token_ids=progress.resumable_token_ids)
    assert summary(finish(engine, "again")) == summary(reference)


def test_seeded_requests_resume_among_neighbours(engine, prompts):
    params = CASES["seeded"]
    references = engine.generate(prompts, params)
    cut = interrupt(engine, "cut", prompts[0], params, at=12)
    neighbour = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    engine.add_request("neighbour-0", prompts[1], neighbour)
    engine.add_request("resumed", prompts[0], params, resumed_token_ids=cut)
    engine.add_request("neighbour-1", prompts[2], neighbour)
    assert summary(finish(engine, "resumed")) == summary(references[0])
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, logprobs=1),
        SamplingParams(temperature=0.8, n=2, max_tokens=20),
        SamplingParams(temperature=0.8, n=1, best_of=2, max_tokens=20),
        SamplingParams(temperature=0, n=2, use_beam_search=True, max_tokens=20),
    ],
)
def test_requests_that_cannot_resume_are_refused_and_report_no_checkpoint(engine, prompts, params):
    assert not can_resume(params)
    with pytest.raises(ResumeError):
        engine.add_request("refused", prompts[0], params, resumed_token_ids=[5, 6])
    assert "refused" not in engine.progress()
    engine.add_request("plain", prompts[0], params)
    engine.step()
    assert engine.progress()["plain"].resumable_token_ids is None
    engine.abort_request("plain")


def test_resumed_tokens_that_already_finish_the_request_or_leave_the_vocabulary_are_refused(engine, prompts):
    eos = engine.eos_token_id
    with pytest.raises(ResumeError, match="finish the request at token 2"):
        engine.add_request("eos", prompts[0], SamplingParams(temperature=0, max_tokens=20), resumed_token_ids=[7, eos])
    with pytest.raises(ResumeError, match="finish the request at token 3"):
        engine.add_request("max", prompts[0], SamplingParams(temperature=0, max_tokens=3), resumed_token_ids=[7] * 5)
    with pytest.raises(ResumeError, match="vocabulary"):
        engine.add_request("vocab", prompts[0], SamplingParams(temperature=0), resumed_token_ids=[7, 10**6])
    assert not engine.has_unfinished_requests()

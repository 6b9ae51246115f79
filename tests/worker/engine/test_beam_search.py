"""Beam search inside the continuous batch gives exactly Hugging Face's beams on the real model, and its
bookkeeping (forks, drops, finished hypotheses, early stopping) on a pure-Python state."""

import pytest
import torch
import transformers

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.core.beam_search import BeamSearchState
from worker.engine.core.request import Sequence

QUESTIONS = [
    "What is 2 + 2? Answer with one number.",
    "Name one primary color. One word only.",
    "Write a haiku about the sea.",
    "Say hello.",
    "What is the capital of Japan? Answer in one word.",
    "List three fruits.",
    "Translate 'thank you' into French. Only the translation.",
    "Is the sky blue? Yes or no.",
]


def make_beam(seq_id, output):
    seq = Sequence(seq_id, "r", 0, SamplingParams(n=2, use_beam_search=True), [1, 2, 3])
    for token in output:
        seq.append_token(token)
    return seq


def test_beam_step_keeps_the_best_candidates_and_finishes_stopped_ones():
    a = make_beam(0, [5])
    a.cumulative_logprob = -1.0
    state = BeamSearchState(width=2, length_penalty=1.0, early_stopping=True, live=[a])
    assert state.report(a, [(9, -0.1), (7, -0.5), (8, -2.0), (6, -3.0)])
    step = state.step({(0, 9): ("stop", None)})
    # 9 stops: it becomes a hypothesis scored (-1.1) / 2; the two best non-stopping candidates live on.
    assert [(t, lp) for _, t, lp in step.kept] == [(7, -0.5), (8, -2.0)]
    assert [p for p, _, _ in step.kept] == [a, a] and step.dropped == [] and not step.done
    assert [(h.token_ids, h.score) for h in state.finished] == [([5, 9], pytest.approx(-0.55))]


def test_early_stopping_ends_once_width_hypotheses_are_finished():
    a, b = make_beam(0, [5]), make_beam(1, [6])
    state = BeamSearchState(width=2, length_penalty=1.0, early_stopping=True, live=[a, b])
    state.report(a, [(9, -0.1), (7, -5.0), (8, -6.0), (4, -7.0)])
    assert state.report(b, [(9, -0.2), (7, -5.5), (8, -6.5), (4, -7.5)])
    step = state.step({(0, 9): ("stop", None), (1, 9): ("stop", None)})
    assert step.done and step.kept == [] and set(map(id, step.dropped)) == {id(a), id(b)}
    assert [h.token_ids for h in state.best(2)] == [[5, 9], [6, 9]]


def test_without_early_stopping_a_better_live_beam_keeps_the_search_going():
    a, b = make_beam(0, [5]), make_beam(1, [6])
    state = BeamSearchState(width=2, length_penalty=1.0, early_stopping=False, live=[a, b])
    state.report(a, [(9, -3.0), (7, -0.1), (8, -6.0), (4, -7.0)])
    state.report(b, [(9, -3.1), (7, -6.5), (8, -6.6), (4, -7.5)])
    step = state.step({(0, 9): ("stop", None), (1, 9): ("stop", None)})
    # top 4: a+7 (-0.1), a+9 (-3.0, stops), b+9 (-3.1, stops), a+8; only a+9 is among the top 2.
    assert not step.done and len(state.finished) == 1
    assert [(p.seq_id, t) for p, t, _ in step.kept] == [(0, 7), (0, 8)] and step.dropped == [b]


@pytest.fixture(scope="module")
def hf_model(served_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(served_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(served_tokenizer):
    template = served_tokenizer.apply_chat_template
    texts = [template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    return [served_tokenizer.encode(text, add_special_tokens=False) for text in texts]


def hf_beams(hf_model, prompt, eos_token_id, **kwargs):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=4,
            num_return_sequences=4,
            do_sample=False,
            max_new_tokens=32,
            **kwargs,
        )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        if eos_token_id in generated:
            generated = generated[: generated.index(eos_token_id) + 1]
        beams.append(generated)
    return beams


@pytest.mark.slow
@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(1.0, True), (1.0, False), (0.6, True), (0.6, False)])
def test_beams_match_hugging_face(served_model_dir, hf_model, chat_prompts, length_penalty, early_stopping):
    engine = LLMEngine(EngineConfig(model=str(served_model_dir), kv_cache_memory_bytes=1 << 27, max_model_len=512))
    params = SamplingParams(
        n=4, use_beam_search=True, length_penalty=length_penalty, early_stopping=early_stopping, max_tokens=32
    )
    outputs = engine.generate(chat_prompts, params)
    assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
    num_finished_early = 0
    for prompt, out in zip(chat_prompts, outputs, strict=True):
        expected = hf_beams(
            hf_model, prompt, engine.eos_token_id, length_penalty=length_penalty, early_stopping=early_stopping
        )
        assert [choice.token_ids for choice in out.outputs] == expected
        num_finished_early += sum(choice.finish_reason == "stop" for choice in out.outputs)
    assert num_finished_early > 0  # the finished-hypothesis rules were exercised


def test_beams_are_unchanged_by_batch_neighbours(tmp_path):
    from tests.helpers.tiny_llama import save_tiny_llama

    model_dir = str(save_tiny_llama(tmp_path))
    prompts = [[5 + (7 * i + j) % 250 for j in range(9 + i)] for i in range(3)]
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(prompt_list, params_list, **overrides):
        fields = {"model": model_dir, "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 32}
        engine = LLMEngine(EngineConfig(**{**fields, **overrides}))
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True)):
            engine.add_request(str(i), prompt, p)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step())
            engine.kv_cache_manager.check_invariants()
        assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
        return [[c.token_ids for c in outputs[str(i)].outputs] for i in range(len(prompt_list))], engine

    alone, _ = run(prompts[:1], [params])
    assert len(alone[0]) == 3 and len({tuple(b) for b in alone[0]}) == 3
    crowded, _ = run([prompts[1], prompts[0], prompts[2]], [greedy, params, params])
    assert crowded[1] == alone[0]


def test_beams_with_forks_disabled_are_the_same_and_hold_more_blocks(tmp_path):
    """``enable_forks=False`` copies every block at each beam fork (bench/forks.py's baseline): the same
    beams, more blocks at the peak, and every block free at the end."""
    from tests.helpers.tiny_llama import save_tiny_llama

    model_dir = str(save_tiny_llama(tmp_path))
    prompts = [[5 + (7 * i + j) % 250 for j in range(9 + i)] for i in range(3)]
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=10, ignore_eos=True)

    def run(enable_forks):
        fields = {"model": model_dir, "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 32}
        engine = LLMEngine(EngineConfig(**fields, enable_forks=enable_forks))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step())
            engine.kv_cache_manager.check_invariants()
        assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
        stats = engine.make_stats()
        assert stats.num_preemptions == 0
        return [[c.token_ids for c in outputs[str(i)].outputs] for i in range(len(prompts))], stats

    forked, forked_stats = run(enable_forks=True)
    copied, copied_stats = run(enable_forks=False)
    assert copied == forked
    assert copied_stats.num_kv_blocks_peak > forked_stats.num_kv_blocks_peak


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_beams_survive_preemption_and_match_the_unpreempted_run(tmp_path, kv_cache_dtype):
    """A KV cache too small for every line's beams at once preempts beams; the search still ends (no
    beam waits forever for a preempted sibling) with the beams of a roomy cache (on the int8 cache too)."""
    from tests.helpers.tiny_llama import save_tiny_llama

    model_dir = str(save_tiny_llama(tmp_path))
    prompts = [[5 + (7 * i + j) % 250 for j in range(9 + i)] for i in range(4)]
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True)

    def run(**overrides):
        fields = {"model": model_dir, "block_size": 4, "max_model_len": 32, "enable_prefix_caching": False}
        engine = LLMEngine(EngineConfig(**{**fields, **overrides}, kv_cache_dtype=kv_cache_dtype))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            outputs.update((out.request_id, out) for out in engine.step())
            engine.kv_cache_manager.check_invariants()
        assert not engine.has_unfinished_requests(), "beam search stalled"
        assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
        return [[c.token_ids for c in outputs[str(i)].outputs] for i in range(len(prompts))], engine.make_stats()

    roomy, roomy_stats = run(kv_cache_memory_bytes=1 << 22)
    # 20 blocks of 4 tokens: one line's 3 beams of up to 24 tokens fit, all four lines' do not.
    tight, tight_stats = run(num_gpu_blocks_override=20)
    assert roomy_stats.num_preemptions == 0 and tight_stats.num_preemptions > 0
    assert tight == roomy


def test_beams_that_cannot_fit_the_cache_side_by_side_are_refused(tmp_path):
    from tests.helpers.tiny_llama import save_tiny_llama
    from worker.engine.errors import InvalidParameterError

    model_dir = str(save_tiny_llama(tmp_path))
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4, max_model_len=32, num_gpu_blocks_override=20))
    with pytest.raises(InvalidParameterError, match="need 24 KV blocks") as info:
        engine.add_request("r", list(range(5, 17)), SamplingParams(n=4, use_beam_search=True, max_tokens=12))
    assert info.value.param == "n"


def test_each_beams_cumulative_logprob_equals_a_plain_rescoring(tmp_path):
    """A returned beam's cumulative logprob is the sum of its tokens' log-softmax under one plain HF
    forward pass over prompt + beam (no cache, batch of one)."""
    from tests.helpers.tiny_llama import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=4, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    )
    prompt = [5 + (11 * j) % 250 for j in range(10)]
    [out] = engine.generate([prompt], SamplingParams(n=3, use_beam_search=True, max_tokens=8, logprobs=0))
    assert len(out.outputs) == 3
    for beam in out.outputs:
        ids = torch.tensor([prompt + beam.token_ids])
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        positions = range(len(prompt) - 1, len(prompt) + len(beam.token_ids) - 1)
        rescored = sum(float(logprobs[pos, token]) for pos, token in zip(positions, beam.token_ids, strict=True))
        assert beam.cumulative_logprob == pytest.approx(rescored, abs=1e-4)

"""LLMEngine on a tiny random GQA Llama: greedy parity with Hugging Face under chunking, preemption,
prefix caching and requests joining mid-run; limits, aborts, stops, logprobs and seeded sampling."""

import random

import pytest
import torch

from tests.helpers.parity import assert_greedy_close, hf_greedy_reference
from worker.engine import EngineConfig, LLMEngine, PromptTooLongError, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(3, 259) for _ in range(9)]  # a common prefix longer than two 4-token blocks
    mixed = [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    return mixed + [shared + [5 + i] * (i + 1) for i in range(3)]


@pytest.fixture(scope="module")
def references(hf_model, prompts):
    return [hf_greedy_reference(hf_model, prompt, MAX_TOKENS) for prompt in prompts]


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), block_size=4, kv_cache_memory_bytes=1 << 22, max_model_len=64)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def run_checked(engine, prompts, params):
    """generate() by hand, checking the KV cache invariants after every step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
    return [outputs[str(i)] for i in range(len(prompts))]


def assert_matches(references, outputs):
    for i, (ref, out) in enumerate(zip(references, outputs)):
        assert_greedy_close(ref.token_ids, ref.top2, out.outputs[0].token_ids, label=f"prompt {i}")
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_batched_greedy_matches_hugging_face(model_dir, prompts, references, enable_prefix_caching):
    engine = make_engine(model_dir, enable_prefix_caching=enable_prefix_caching)
    outputs = run_checked(engine, prompts, GREEDY)
    assert_matches(references, outputs)
    assert engine.make_stats().num_preemptions == 0


def test_chunked_prefill_matches_hugging_face(model_dir, prompts, references):
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    assert max(len(p) for p in prompts) > 8  # some prompt cannot be prefilled in one step
    assert_matches(references, run_checked(engine, prompts, GREEDY))


def test_preemption_recomputes_and_matches_hugging_face(model_dir, prompts, references):
    engine = make_engine(model_dir, num_gpu_blocks_override=16, max_num_batched_tokens=32)
    outputs = run_checked(engine, prompts, GREEDY)
    assert engine.make_stats().num_preemptions > 0
    assert_matches(references, outputs)


def test_prefix_cache_hits_are_counted_and_invisible(model_dir, prompts, references):
    engine = make_engine(model_dir)
    first = engine.generate([prompts[-1]], GREEDY)[0]
    rest = engine.generate(prompts[-3:-1], GREEDY)
    assert first.num_cached_tokens == 0
    assert [out.num_cached_tokens for out in rest] == [8, 8]  # two full blocks of the shared 9-token prefix
    assert engine.make_stats().num_cached_tokens == 16
    assert_matches(references[-3:], rest + [first])


def test_requests_join_a_running_batch(model_dir, prompts, references):
    engine = make_engine(model_dir)
    engine.add_request("early", prompts[0], GREEDY)
    for _ in range(3):
        assert engine.step() == []
    engine.add_request("late", prompts[1], GREEDY)
    engine.step()
    assert {seq.request_id for seq in engine.scheduler.running} == {"early", "late"}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    assert_matches(references[:2], [outputs["early"], outputs["late"]])


def test_prompt_too_long_and_generation_stops_at_max_model_len(model_dir):
    engine = make_engine(model_dir, max_model_len=20)
    with pytest.raises(PromptTooLongError) as excinfo:
        engine.add_request("long", list(range(3, 23)), GREEDY)
    assert (excinfo.value.num_prompt_tokens, excinfo.value.max_model_len) == (20, 20)
    assert isinstance(excinfo.value, ValueError)
    [out] = engine.generate([list(range(3, 18))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds"):
        make_engine(model_dir, max_model_len=1000)
    with pytest.raises(ValueError, match="KV cache"):
        make_engine(model_dir, num_gpu_blocks_override=4, max_model_len=64)


def test_a_kv_cache_too_small_for_one_sequence_names_the_settings_that_make_it_fit(model_dir):
    per_block = make_engine(model_dir).model_runner.bytes_per_block  # float32, 4-token blocks
    budget = 127 * per_block  # one block short of the model's 512 positions
    with pytest.raises(ValueError) as excinfo:
        make_engine(model_dir, kv_cache_memory_bytes=budget, max_model_len=None)
    assert str(excinfo.value) == (
        "the KV cache holds 127 blocks of 4 tokens, fewer than one sequence of max_model_len=512 tokens (the model's "
        f"max_position_embeddings) needs (128 blocks); raise kv_cache_memory_bytes (BATCHINFER_KV_CACHE_MEMORY_BYTES, "
        f"now {budget}) to at least {128 * per_block}, or set kv_cache_dtype (BATCHINFER_KV_CACHE_DTYPE) to 'int8' "
        "or 'fp8_e4m3' (one byte an element), or 'int4' (half a byte), or run the model in bfloat16 (dtype, "
        "BATCHINFER_DTYPE=bfloat16: a bfloat16 KV cache)"
    )
    # the advice holds: the same bytes hold the sequence in a bfloat16 or an int8 cache
    for fix in ({"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"}):
        engine = make_engine(model_dir, kv_cache_memory_bytes=budget, max_model_len=None, **fix)
        assert engine.model_runner.num_blocks >= 128
    with pytest.raises(ValueError, match=r"to 'int4' \(half a byte an element\)$"):
        make_engine(model_dir, kv_cache_memory_bytes=per_block, kv_cache_dtype="int8")


def test_a_kv_cache_larger_than_the_available_memory_is_refused_at_start(model_dir):
    import psutil

    budget = 2 * psutil.virtual_memory().available
    with pytest.raises(
        ValueError, match=r"this machine has \d+ bytes of memory available: lower kv_cache_memory_bytes"
    ):
        make_engine(model_dir, kv_cache_memory_bytes=budget)


def test_abort_frees_everything(model_dir, prompts):
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    engine.step()
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    engine.abort_request("unknown")
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_seqs()
    assert engine.kv_cache_manager.num_free_blocks == engine.model_runner.num_blocks
    engine.kv_cache_manager.check_invariants()


def test_stop_string_truncates_text(model_dir):
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode("Hello there")
    [full] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = full.outputs[0].text
    stop = next(ch for ch in text[2:] if ch.isascii() and ch.isprintable())
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_eos_stops_unless_ignored(model_dir, prompts):
    engine = make_engine(model_dir)
    eos = engine.eos_token_id
    bias = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    [stopped] = engine.generate([prompts[0]], bias)
    assert stopped.outputs[0].token_ids == [eos] and stopped.outputs[0].finish_reason == "stop"
    bias.ignore_eos = True
    [ignored] = engine.generate([prompts[0]], bias)
    assert ignored.outputs[0].token_ids == [eos] * 8 and ignored.outputs[0].finish_reason == "length"


def test_no_logprobs_asked_means_none_reported(model_dir, prompts):
    """As in vLLM: without ``logprobs`` a completion reports neither logprobs nor a cumulative logprob,
    also when a neighbour in the same batch asked for them."""
    engine = make_engine(model_dir)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)

    outs = engine.generate(prompts[:3], [plain, asked, plain])

    assert [o.outputs[0].cumulative_logprob is None for o in outs] == [True, False, True]
    assert [o.outputs[0].logprobs is None for o in outs] == [True, False, True]
    assert outs[1].outputs[0].cumulative_logprob < 0


def test_logprobs_and_prompt_logprobs_match_hugging_face(model_dir, hf_model, prompts):
    engine = make_engine(model_dir, max_num_batched_tokens=8)  # prompt logprobs over several chunks
    prompt = prompts[2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = engine.generate([prompt], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and len(entry) == 2  # greedy: the sampled token is the top one
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
    )
    with torch.inference_mode():
        hf_logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        target = prompt[position]
        assert entry[target].logprob == pytest.approx(hf_logprobs[position - 1, target].item(), abs=1e-4)
        top_id = int(hf_logprobs[position - 1].argmax())
        assert top_id in entry


def test_seeded_samples_are_distinct_and_independent_of_the_batch(model_dir, prompts):
    engine = make_engine(model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    [alone] = engine.generate([prompts[0]], params)
    crowded = engine.generate([prompts[1], prompts[0], prompts[3]], [GREEDY, params, params])
    samples = [out.token_ids for out in alone.outputs]
    assert [out.index for out in alone.outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) == 3
    assert [out.token_ids for out in crowded[1].outputs] == samples


def test_stats_and_request_metrics_count_each_token_once(model_dir, prompts):
    """vLLM's meanings: prompt tokens once per request, one TTFT per request, one inter-token gap per later
    token, scheduled tokens per step; each request's stage times are ordered."""
    engine = make_engine(model_dir, num_gpu_blocks_override=16, max_num_batched_tokens=32)
    outputs = run_checked(engine, prompts, GREEDY)
    stats = engine.make_stats()
    assert stats.num_preemptions > 0  # recomputed tokens must not count as new prompt tokens or new gaps
    assert stats.num_prompt_tokens == sum(len(prompt) for prompt in prompts)
    assert len(stats.time_to_first_tokens_s) == len(prompts)
    assert len(stats.inter_token_latencies_s) == stats.num_generation_tokens - len(prompts)
    assert stats.num_generation_tokens == len(prompts) * MAX_TOKENS
    assert len(stats.num_tokens_per_step) == stats.num_steps
    # every prompt token the prefix cache did not supply, and every sampled token but each request's last,
    # passes through the model at least once (preemption recomputes some twice)
    num_computed_at_least = (
        stats.num_prompt_tokens - stats.num_cached_tokens + stats.num_generation_tokens - len(prompts)
    )
    assert sum(stats.num_tokens_per_step) >= num_computed_at_least
    assert max(stats.num_tokens_per_step) <= 32
    assert min(stats.time_to_first_tokens_s + stats.inter_token_latencies_s) > 0
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    for output in outputs:
        m = output.metrics
        assert m is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    fresh = engine.make_stats()
    assert (fresh.num_prompt_tokens, fresh.time_to_first_tokens_s, fresh.num_tokens_per_step) == (0, [], [])


def test_waiting_and_running_counts_are_taken_when_stats_are_made(model_dir, prompts):
    engine = make_engine(model_dir, max_num_seqs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    stats = engine.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, len(prompts))
    engine.step()
    stats = engine.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, len(prompts) - 2)
    for i in range(len(prompts)):
        engine.abort_request(str(i))


@pytest.fixture(scope="module")
def quantized_alone(model_dir, prompts):
    """Each prompt run alone on a quantized cache without the prefix cache, by ``kv_cache_dtype``: the reference
    of that cache's features."""
    runs: dict[str, list] = {}

    def alone(kv_cache_dtype):
        if kv_cache_dtype not in runs:
            engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
            runs[kv_cache_dtype] = [engine.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in prompts]
        return runs[kv_cache_dtype]

    return alone


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 8}, {"num_gpu_blocks_override": 16, "max_num_batched_tokens": 32}],
    ids=["batched-prefix-cached", "chunked", "preempted"],
)
def test_quantized_cache_batched_chunked_and_preempted_equal_each_prompt_alone(
    model_dir, prompts, quantized_alone, overrides, kv_cache_dtype
):
    """Every path reads the same dequantized values (a fresh prompt its own stored K/V too), so batching,
    chunked prefill, preemption and prefix-cache hits change nothing on the int8 (or int4) cache either."""
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype, **overrides)
    outputs = run_checked(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == quantized_alone(kv_cache_dtype)
    assert (engine.make_stats().num_preemptions > 0) == ("num_gpu_blocks_override" in overrides)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "element_bytes"), [("auto", 16 * 4), ("int8", 16 + 4), ("fp8", 16 + 4), ("int4", 8 + 2 * 4)]
)
def test_the_block_count_at_a_fixed_budget_is_the_byte_ratio(model_dir, kv_cache_dtype, element_bytes):
    """Tiny Llama: 2 layers, 2 KV heads of 16; a (token, KV head) takes 16 float32 or 16 bytes and a float32 scale
    (int4: 8 bytes and one group's float32 scale and zero)."""
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=1 << 20)
    runner = engine.model_runner
    assert runner.bytes_per_block == 2 * 2 * 4 * 2 * element_bytes
    assert runner.num_blocks == (1 << 20) // runner.bytes_per_block
    assert engine.config.kv_cache_dtype == ("fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype)


def test_unknown_kv_cache_dtype_is_refused(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'int8', 'fp8_e4m3', 'int4', 'fp8'"):
        EngineConfig(model=str(model_dir), kv_cache_dtype="int2")

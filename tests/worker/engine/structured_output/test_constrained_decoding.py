"""Structured outputs on the real SmolLM2-135M-Instruct: every finished output parses and validates, with every
engine feature on (docs/engine.md, "Structured outputs").

Many constraints share each engine run and outputs are short (CI has 2 cores). Outputs that end with
``length`` are cut by ``max_tokens`` and only need to be a prefix the grammar allowed; ``stop`` ones must be whole.
"""

import json
import re

import jsonschema
import pytest

from tests.helpers.parity import chat_prompt_ids
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
NAME = {"type": "string", "maxLength": 12}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
POINT = {
    "type": "object",
    "properties": {"x": SMALL_INT, "y": SMALL_INT},
    "required": ["x", "y"],
    "additionalProperties": False,
}


def obj(properties, required=None, **extra):
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


# (what to ask for, schema): enums, nested objects, arrays with min/max items, bounded numbers, string patterns,
# anyOf, $ref/$defs, additionalProperties false, and top-level non-objects.
SCHEMAS = [
    ("the sentiment of 'I love it'", obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    (
        "a person with an address",
        obj({"name": NAME, "address": obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    ),
    (
        "two or three digits",
        obj(
            {
                "digits": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 3,
                }
            }
        ),
    ),
    ("a probability", obj({"score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a flight code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})),
    ("a number or a yes/no", obj({"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}})),
    (
        "a line from one point to another",
        {"$defs": {"point": POINT}, **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    ),
    ("a product, price optional", obj({"product": NAME, "price": SMALL_INT}, required=["product"])),
    ("whether water is wet", obj({"answer": {"type": "boolean"}})),
    (
        "one or two colours",
        obj({"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 2}}),
    ),
    ("a temperature", obj({"celsius": {"type": "integer", "exclusiveMinimum": -50, "exclusiveMaximum": 60}})),
    ("a version", obj({"version": {"const": "v1"}, "patch": SMALL_INT})),
    ("a list of points", obj({"points": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 2}})),
    ("a nickname", obj({"nickname": {"type": "string", "minLength": 2, "maxLength": 8}})),
    ("a middle name if any", obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}})),
    ("three small numbers", {"type": "array", "items": SMALL_INT, "minItems": 3, "maxItems": 3}),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("an age", {"type": "integer", "minimum": 18, "maximum": 65}),
    (
        "a book",
        obj(
            {
                "title": NAME,
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "genre": {"enum": ["fiction", "science"]},
            }
        ),
    ),
    (
        "a labelled point",
        {
            "$defs": {"label": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            **obj({"label": {"$ref": "#/$defs/label"}, "at": POINT}),
        },
    ),
    ("a shape", obj({"shape": {"anyOf": [obj({"circle": SMALL_INT}), obj({"square": SMALL_INT})]}})),
    ("a score out of ten", obj({"rating": {"type": "number", "minimum": 0, "maximum": 10}, "ok": {"type": "boolean"}})),
]
CHOICES = ("positive", "negative", "not sure")
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
GBNF = r"""root ::= "The answer is " answer "."
answer ::= "yes" | "no" | number
number ::= [1-9] [0-9]*"""


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), kv_cache_memory_bytes=64 << 20, max_model_len=512)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


@pytest.fixture(scope="module")
def engine(served_model_dir):
    return make_engine(served_model_dir)


@pytest.fixture(scope="module")
def prompts(served_tokenizer):
    questions = [f"Reply in JSON with {what}." for what, _ in SCHEMAS]
    extra = ["Is 'great movie' positive or negative?", "Name a city and a number.", "Is the sky blue?"]
    return chat_prompt_ids(served_tokenizer, questions + extra)


def constrained(params_list):
    """One params per schema, then the choice, regex and GBNF constraints, from ``params(constraint)``."""
    json_constraints = [StructuredOutputsParams(json=schema) for _, schema in SCHEMAS]
    others = [
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(grammar=GBNF),
    ]
    return [params_list(c) for c in json_constraints + others]


def check(outputs, *, min_stopped, indices=None):
    """Every ``stop`` output is whole and valid (output ``j`` answers constraint ``indices[j]``, by default ``j``);
    at least ``min_stopped`` of the completions stopped."""
    num_stopped = 0
    for j, output in enumerate(outputs):
        i = j if indices is None else indices[j]
        for completion in output.outputs:
            if completion.finish_reason != "stop":
                assert completion.finish_reason == "length"
                assert len(completion.token_ids) == MAX_TOKENS
                continue
            num_stopped += 1
            text = completion.text
            if i < len(SCHEMAS):
                jsonschema.validate(json.loads(text), SCHEMAS[i][1])
            elif i == len(SCHEMAS):
                assert text in CHOICES
            elif i == len(SCHEMAS) + 1:
                assert re.fullmatch(REGEX, text), text
            else:
                assert re.fullmatch(r"The answer is (yes|no|[1-9][0-9]*)\.", text), text
    assert num_stopped >= min_stopped
    return num_stopped


def test_greedy_sampled_and_beams_are_valid(engine, prompts):
    greedy = constrained(lambda c: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c))
    sampled = constrained(
        lambda c: SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS, structured_outputs=c)
    )
    outputs = engine.generate(prompts + prompts, greedy + sampled)
    check(outputs[: len(prompts)], min_stopped=len(prompts) * 3 // 4)
    check(outputs[len(prompts) :], min_stopped=len(prompts) * 2)
    beams = constrained(
        lambda c: SamplingParams(temperature=0, n=4, use_beam_search=True, max_tokens=MAX_TOKENS, structured_outputs=c)
    )
    # Beam search keeps 4 beams per line: half the lines keep the run short.
    indices = list(range(0, len(prompts), 2))
    check(engine.generate(prompts[::2], beams[::2]), min_stopped=len(indices) * 2, indices=indices)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks


def test_greedy_with_speculation_preemption_and_chunks_equals_plain(served_model_dir, engine, prompts):
    """Constrained greedy ids are the same with n-gram speculation on, under preemption (a tiny KV cache) and
    with chunked prefill; and speculated sampled outputs are valid too."""
    greedy = constrained(lambda c: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c))
    plain = engine.generate(prompts, greedy)
    variants = {
        "speculation": make_engine(served_model_dir, speculative_mode="on"),
        # n-gram trees: a constrained line keeps each tree's leading chain
        "speculation with trees": make_engine(served_model_dir, speculative_mode="on", speculative_tree_width=3),
        "preemption": make_engine(
            served_model_dir, num_gpu_blocks_override=24, max_model_len=128, enable_prefix_caching=False
        ),
        "chunked prefill": make_engine(served_model_dir, max_num_batched_tokens=16, enable_prefix_caching=False),
    }
    for name, variant in variants.items():
        outputs = variant.generate(prompts, greedy)
        for i, (ref, out) in enumerate(zip(plain, outputs, strict=True)):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"{name}: line {i}"
            assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason, f"{name}: line {i}"
    stats = variants["speculation"].make_stats()
    assert stats.num_drafts > 0
    assert variants["preemption"].make_stats().num_preemptions > 0
    sampled = constrained(lambda c: SamplingParams(temperature=0.8, n=2, max_tokens=MAX_TOKENS, structured_outputs=c))
    check(variants["speculation"].generate(prompts, sampled), min_stopped=len(prompts))


def test_logprobs_are_of_the_raw_distribution(engine, served_tokenizer):
    (prompt,) = chat_prompt_ids(served_tokenizer, ["What is the capital of France?"])
    forced = SamplingParams(
        temperature=0, max_tokens=4, logprobs=0, structured_outputs=StructuredOutputsParams(choice=("Paris",))
    )
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    constrained_out, free_out = engine.generate([prompt, prompt], [forced, free])
    first_id = constrained_out.outputs[0].token_ids[0]
    raw = free_out.outputs[0].logprobs[0]
    assert first_id in raw
    logprob = constrained_out.outputs[0].logprobs[0][first_id].logprob
    assert logprob < 0  # renormalised over the allowed tokens it would be 0
    assert logprob == pytest.approx(raw[first_id].logprob, abs=1e-5)


def test_max_tokens_cuts_with_length_and_stop_strings_apply(engine, prompts):
    schema = SCHEMAS[1][1]
    cut = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(json=schema))
    stopped = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        stop=['"address"'],
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    (cut_out, stop_out) = engine.generate([prompts[1], prompts[1]], [cut, stopped])
    assert cut_out.outputs[0].finish_reason == "length"
    assert len(cut_out.outputs[0].token_ids) == 5
    assert stop_out.outputs[0].finish_reason == "stop"
    assert stop_out.outputs[0].stop_reason == '"address"'
    assert stop_out.outputs[0].text.startswith('{"name": "')

"""Bad constraints fail their request with ``InvalidParameterError(param="structured_outputs")``, before any engine
work, and leave the engine serving; the compile cache and its time limit (docs/engine.md, "Structured outputs").

A tiny random-weight Llama with a byte-level vocabulary keeps these fast: the grammar, not the model, decides
what is valid, so even random weights must give outputs that parse.
"""

import json
import re

import jsonschema
import pytest

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.errors import InvalidParameterError
from worker.engine.sampling_params import StructuredOutputsParams
from worker.engine.structured_output import validate_structured_outputs

BAD_CONSTRAINTS = {
    "schema not JSON": dict(json="{not json"),
    "schema not an object": dict(json="[1, 2]"),
    "unknown type": dict(json={"type": "foo"}),
    "minimum not a number": dict(json={"type": "integer", "minimum": "zero"}),
    "required not a list": dict(json={"type": "object", "required": "name"}),
    "unsupported uniqueItems": dict(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    "unsupported if/then": dict(json={"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
    "pattern does not compile": dict(json={"type": "string", "pattern": "(("}),
    "dangling $ref": dict(json={"$ref": "#/$defs/missing"}),
    # Keywords xgrammar accepts but does not enforce: each allowed a finished output that broke its schema.
    "unsupported not": dict(json={"type": "integer", "not": {"minimum": 0}}),
    "unsupported contains": dict(json={"type": "array", "contains": {"const": 7}}),
    "unsupported oneOf": dict(json={"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]}),
    "unsupported dependentRequired": dict(json={"type": "object", "dependentRequired": {"a": ["b"]}}),
    "allOf of several schemas": dict(json={"allOf": [{"type": "integer"}, {"minimum": 10}]}),
    "required but undeclared": dict(json={"type": "object", "required": ["xa"]}),
    "minProperties above the declared": dict(json={"type": "object", "minProperties": 1}),
    "remote $ref": dict(json={"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}),
    "regex does not compile": dict(regex="a(b"),
    "regex bad repetition": dict(regex="a{3,1}"),
    "grammar syntax error": dict(grammar='root ::= "a" |'),
    "grammar without root": dict(grammar='start ::= "a"'),
    "grammar undefined rule": dict(grammar="root ::= value"),
}


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=8 << 20, max_model_len=256))


@pytest.mark.parametrize("case", BAD_CONSTRAINTS)
def test_bad_constraint_fails_its_request_only(engine, case):
    constraint = StructuredOutputsParams(**BAD_CONSTRAINTS[case])
    with pytest.raises(InvalidParameterError) as early:
        validate_structured_outputs(constraint)
    assert early.value.param == "structured_outputs"
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=constraint)
    with pytest.raises(InvalidParameterError) as raised:
        engine.add_request(f"bad-{case}", [5, 6, 7], params)
    assert raised.value.param == "structured_outputs"
    assert str(raised.value) == str(early.value)
    assert not engine.has_unfinished_requests()
    # The engine lives and serves its neighbours.
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


def test_names_and_values_that_look_like_keywords_are_data():
    schema = {
        "type": "object",
        "properties": {"if": {"type": "boolean"}, "mode": {"enum": [{"uniqueItems": 1}], "default": {"then": 2}}},
        "$defs": {"else": {"type": "integer"}},
        "required": ["if"],
    }
    validate_structured_outputs(StructuredOutputsParams(json=schema))
    nested = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(InvalidParameterError, match="uniqueItems"):
        validate_structured_outputs(StructuredOutputsParams(json=nested))


def test_refusals_name_what_to_do_and_enforced_forms_pass():
    with pytest.raises(InvalidParameterError, match=r"oneOf \(use anyOf for oneOf\)"):
        validate_structured_outputs(StructuredOutputsParams(json={"oneOf": [{"type": "integer"}]}))
    with pytest.raises(InvalidParameterError, match="requires 'xa', which its properties do not declare"):
        validate_structured_outputs(StructuredOutputsParams(json={"type": "object", "required": ["xa"]}))
    with pytest.raises(InvalidParameterError, match="asks for minProperties 1 but its properties declare 0"):
        validate_structured_outputs(StructuredOutputsParams(json={"type": "object", "minProperties": 1}))
    # One schema in allOf (pydantic's wrapper of a $ref) and local references are enforced as they are.
    enforced = {
        "type": "object",
        "properties": {"pet": {"allOf": [{"$ref": "#/$defs/Pet"}]}},
        "required": ["pet"],
        "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    }
    validate_structured_outputs(StructuredOutputsParams(json=enforced))


def test_compile_timeout_fails_the_line_and_the_engine_goes_on(model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_memory_bytes=8 << 20,
            max_model_len=256,
            structured_outputs_compile_timeout_s=0.02,
        )
    )
    slow = StructuredOutputsParams(json={"type": "string", "pattern": "[a-z]{1,1000}"})  # about 1 s
    with pytest.raises(InvalidParameterError, match=r"longer than 0\.02 s to compile") as raised:
        engine.add_request("slow", [5, 6], SamplingParams(max_tokens=4, structured_outputs=slow))
    assert raised.value.param == "structured_outputs"
    (out,) = engine.generate(
        [[5, 6]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="ab+"))
    )
    assert re.fullmatch("ab+", out.outputs[0].text)


def test_each_constraint_compiles_once(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=8 << 20, max_model_len=256))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    same = [
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json=json.dumps(schema, indent=2)),  # the same schema as other text
    ]
    other = StructuredOutputsParams(regex="[0-9]+")
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=c) for c in [*same, other, other]]
    engine.generate([[5, 6, 7]] * len(params), params)
    stats = engine.make_stats()
    assert len(stats.grammar_compile_times_s) == 2
    assert stats.grammar_cache_hits == 2


def test_random_weights_still_give_valid_outputs(engine):
    """Whatever the model prefers, the grammar decides: greedy, sampled n=3, beams, speculation."""
    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
        },
        "required": ["kind", "count", "tags"],
        "additionalProperties": False,
    }
    json_constraint = StructuredOutputsParams(json=schema)
    choice = StructuredOutputsParams(choice=("alpha", "beta", "gamma delta"))
    regex = StructuredOutputsParams(regex=r"[a-c]{2,4}-\d\d")
    cases = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=json_constraint),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=64, structured_outputs=json_constraint),
        SamplingParams(temperature=0, n=3, use_beam_search=True, max_tokens=64, structured_outputs=json_constraint),
        SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=16, structured_outputs=choice),
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=16, structured_outputs=regex),
        SamplingParams(temperature=1.0, seed=5, min_tokens=12, max_tokens=16, structured_outputs=regex),
    ]
    outputs = engine.generate([[5, 6, 7]] * len(cases), cases)
    checks = [lambda text: jsonschema.validate(json.loads(text), schema)] * 3 + [
        lambda text: assert_in(text, choice.choice),
        lambda text: assert_fullmatch(regex.regex, text),
        lambda text: assert_fullmatch(regex.regex, text),
    ]
    for output, check in zip(outputs, checks, strict=True):
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                check(completion.text)
    assert all(c.finish_reason == "stop" for o in outputs[3:] for c in o.outputs)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks


def assert_in(text, choices):
    assert text in choices


def assert_fullmatch(pattern, text):
    assert re.fullmatch(pattern, text), text


def test_jump_forward_appends_forced_tokens_and_outputs_stay_valid(model_dir):
    """Jump-forward decoding takes fewer steps for the same valid outputs; not where logprobs are asked for."""
    schema = {
        "type": "object",
        "properties": {"category": {"enum": ["alphabet", "numbers"]}, "n": {"type": "integer", "minimum": 0}},
        "required": ["category", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    results = {}
    for jump in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir), kv_cache_memory_bytes=8 << 20, max_model_len=256, enable_jump_forward=jump
            )
        )
        (out,) = engine.generate([[5, 6, 7]], params)
        results[jump] = (out.outputs[0], engine.make_stats())
        (with_logprobs,) = engine.generate([[5, 6, 7]], SamplingParams(**{**_fields(params), "logprobs": 0}))
        assert len(with_logprobs.outputs[0].logprobs) == len(with_logprobs.outputs[0].token_ids)
        assert engine.make_stats().num_forced_tokens == 0
    for completion, _ in results.values():
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
    jumped, jump_stats = results[True]
    _, masked_stats = results[False]
    assert jump_stats.num_forced_tokens >= len('{"category": "')
    assert masked_stats.num_forced_tokens == 0
    assert jump_stats.num_steps < masked_stats.num_steps
    assert jumped.finish_reason == "stop"


def _fields(params):
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.errors import InvalidRequest
from jobs.line_body import parse_body
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, ChatCompletionBody, CompletionBody
from worker.engine import SamplingParams
from worker.engine.sampling_params import StructuredOutputsParams
from worker.request_mapping import map_request


def test_completion_string_prompt_uses_tokenizer_count_and_defaults(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "def add(a, b):\n"}, served_tokenizer)
    assert mapped.prompt == "def add(a, b):\n"
    assert mapped.prompt_token_ids == served_tokenizer.encode("def add(a, b):\n")
    assert mapped.params.max_tokens == 16  # OpenAI's completions default
    assert mapped.params.temperature == 1.0
    assert mapped.params.logprobs is None
    assert mapped.echo is False


def test_completion_token_id_prompt_is_fed_as_is(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": [1604, 275, 24]}, served_tokenizer)
    assert mapped.prompt is None
    assert mapped.prompt_token_ids == [1604, 275, 24]


def test_completion_sampling_fields_and_vllm_extensions(served_tokenizer):
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 128,
        "temperature": 0,
        "top_p": 0.5,
        "n": 3,
        "seed": 7,
        "stop": "\ndef ",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "logit_bias": {"42": -100, "7": 5.5},
        "logprobs": 2,
        "echo": True,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
    }
    params = map_request(COMPLETIONS, body, served_tokenizer).params
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.seed) == (128, 0.0, 0.5, 3, 7)
    assert params.stop == ["\ndef "]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.logit_bias == {42: -100.0, 7: 5.5}
    assert params.logprobs == 2 and params.prompt_logprobs == 2
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (5, 0.1, 1.2, 2)
    assert params.ignore_eos and params.include_stop_str_in_output
    assert params.stop_token_ids == [2]


def test_chat_prompt_is_the_models_chat_template(served_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    mapped = map_request(CHAT_COMPLETIONS, {"model": "m", "messages": messages}, served_tokenizer)
    expected = served_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert mapped.prompt == expected
    assert mapped.prompt.endswith("<|im_start|>assistant\n")
    expected_ids = served_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert mapped.prompt_token_ids == list(expected_ids)
    assert mapped.prompt_token_ids.count(served_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert mapped.params.max_tokens is None  # chat: up to the context limit


def test_chat_text_parts_equal_plain_content(served_tokenizer):
    plain = map_request(
        CHAT_COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}, served_tokenizer
    )
    parts = map_request(
        CHAT_COMPLETIONS,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
            ],
        },
        served_tokenizer,
    )
    assert parts.prompt_token_ids == plain.prompt_token_ids


def test_chat_max_completion_tokens_wins_and_logprobs(served_tokenizer):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 3,
    }
    params = map_request(CHAT_COMPLETIONS, body, served_tokenizer).params
    assert params.max_tokens == 9
    assert params.logprobs == 3
    assert params.prompt_logprobs is None
    no_top = map_request(
        CHAT_COMPLETIONS, {"model": "m", "messages": body["messages"], "logprobs": True}, served_tokenizer
    )
    assert no_top.params.logprobs == 0


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": {"a": 1}}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "stop": [1, 2]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        (COMPLETIONS, {"prompt": "x", "echo": "yes"}, "echo"),
        (COMPLETIONS, {"prompt": "x", "use_beam_search": True, "temperature": 0.5}, "temperature"),
        (CHAT_COMPLETIONS, {"messages": []}, "messages"),
        (CHAT_COMPLETIONS, {"messages": [{"content": "no role"}]}, "messages[0].role"),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/moderations", {"input": "x"}, "url"),
    ],
)
def test_rejected_bodies_name_the_field(served_tokenizer, endpoint, body, param):
    with pytest.raises(InvalidRequest) as info:
        map_request(endpoint, {"model": "m", **body}, served_tokenizer)
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}: ") or param == "url"


def test_request_mapping_holds_no_body_rule():
    """Body rules (limits, defaults, cross-field checks) live in the schemas alone: the worker's mapping
    has no numeric literal, names no limit constant and raises no invalid-request error of its own."""
    import ast
    from pathlib import Path

    from worker import request_mapping

    source = Path(request_mapping.__file__).read_text()
    tree = ast.parse(source)
    numbers = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool)
    ]
    assert numbers == []
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not {name for name in names if name.lstrip("_").startswith(("MAX_", "MIN_")) or "DEFAULT" in name}
    assert not any(isinstance(node, ast.Raise) for node in ast.walk(tree))


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 140),
    st.floats(-3, 3, allow_nan=False),
    st.text("ab\n", max_size=2),
    st.lists(st.integers(-2, 5), max_size=3),
    st.lists(st.text("ab", max_size=2), max_size=5),
    st.dictionaries(st.sampled_from(["0", "42", "x"]), st.floats(-150, 150, allow_nan=False), max_size=2),
)
# Every optional field either schema knows, and "suffix", which neither does (an unknown field).
_OPTIONAL_FIELDS = sorted(
    (set(ChatCompletionBody.model_fields) | set(CompletionBody.model_fields)) - {"model", "messages", "prompt"}
) + ["suffix"]
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "robot"]),
        "content": st.one_of(st.text("hi", max_size=3), st.none(), st.integers()),
    }
)
_EXTRA_FIELDS = st.dictionaries(st.sampled_from(_OPTIONAL_FIELDS), _ANY_VALUE, max_size=3)
_BODIES = st.one_of(
    st.tuples(
        st.just(COMPLETIONS),
        st.builds(
            lambda prompt, extra: {"model": "m", "prompt": prompt, **extra},
            st.one_of(st.text("ab", max_size=3), st.lists(st.integers(-1, 9), max_size=3), st.just(["a"]), _ANY_VALUE),
            _EXTRA_FIELDS,
        ),
    ),
    st.tuples(
        st.just(CHAT_COMPLETIONS),
        st.builds(
            lambda messages, extra: {"model": "m", "messages": messages, **extra},
            st.lists(_MESSAGE, max_size=2),
            _EXTRA_FIELDS,
        ),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_BODIES)
def test_the_api_and_the_worker_decide_alike_on_any_body(served_tokenizer, case):
    """The decision the API documents for a body (the schema's: accepted, or a 400 naming ``param``) is the
    worker's: same verdict, same param and message; and what the schema accepts the engine's own
    `SamplingParams` checks accept too (no ValueError escapes the worker)."""
    endpoint, body = case
    try:
        parsed = parse_body(endpoint, body)
    except InvalidRequest as api_error:
        with pytest.raises(InvalidRequest) as worker_error:
            map_request(endpoint, body, served_tokenizer)
        assert (worker_error.value.param, worker_error.value.message) == (api_error.param, api_error.message)
        return
    mapped = map_request(endpoint, body, served_tokenizer)
    # A structured output constraint (e.g. ``guided_regex: ""``) is the one thing not in ``sampling_kwargs``.
    assert replace(mapped.params, structured_outputs=None) == SamplingParams(**parsed.sampling_kwargs())
    assert (mapped.params.structured_outputs is None) == (parsed.constraint is None)
    assert mapped.prompt_token_ids


_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["spam", "ham"]}},
    "required": ["label"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("endpoint", "fields", "expected", "param"),
    [
        (
            CHAT_COMPLETIONS,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": _SCHEMA}}},
            StructuredOutputsParams(json=_SCHEMA),
            "response_format.json_schema.schema",
        ),
        (
            CHAT_COMPLETIONS,
            {"response_format": {"type": "json_object"}},
            StructuredOutputsParams(json_object=True),
            "response_format",
        ),
        (CHAT_COMPLETIONS, {"response_format": {"type": "text"}}, None, None),
        (
            COMPLETIONS,
            {"structured_outputs": {"choice": ["spam", "ham"]}},
            StructuredOutputsParams(choice=("spam", "ham")),
            "structured_outputs.choice",
        ),
        (
            COMPLETIONS,
            {"structured_outputs": {"regex": "[0-9]{4}"}},
            StructuredOutputsParams(regex="[0-9]{4}"),
            "structured_outputs.regex",
        ),
        (
            CHAT_COMPLETIONS,
            {"structured_outputs": {"grammar": 'root ::= "a"+'}},
            StructuredOutputsParams(grammar='root ::= "a"+'),
            "structured_outputs.grammar",
        ),
        (
            COMPLETIONS,
            {"structured_outputs": {"json_object": True}},
            StructuredOutputsParams(json_object=True),
            "structured_outputs.json_object",
        ),
        (COMPLETIONS, {"guided_json": _SCHEMA}, StructuredOutputsParams(json=_SCHEMA), "guided_json"),
        (
            RESPONSES,
            {"text": {"format": {"type": "json_schema", "name": "l", "schema": _SCHEMA, "strict": True}}},
            StructuredOutputsParams(json=_SCHEMA),
            "text.format.schema",
        ),
        (
            RESPONSES,
            {"text": {"format": {"type": "json_object"}}},
            StructuredOutputsParams(json_object=True),
            "text.format",
        ),
    ],
)
def test_structured_outputs_reach_the_sampling_params_with_the_field_they_came_from(
    served_tokenizer, endpoint, fields, expected, param
):
    prompt = {CHAT_COMPLETIONS: {"messages": [{"role": "user", "content": "Spam?"}]}, COMPLETIONS: {"prompt": "Spam?"}}
    body = {"model": "m", **prompt.get(endpoint, {"input": "Spam?"}), "temperature": 0, **fields}
    mapped = map_request(endpoint, body, served_tokenizer)
    assert mapped.params.structured_outputs == expected
    assert mapped.structured_outputs_param == param
    assert mapped.params.temperature == 0.0


def test_a_responses_line_is_rendered_with_the_chat_template(served_tokenizer):
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]}],
        "max_output_tokens": 12,
        "seed": 5,
    }
    mapped = map_request(RESPONSES, body, served_tokenizer)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    expected = served_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert mapped.prompt == expected
    assert mapped.prompt_token_ids == served_tokenizer.encode(expected, add_special_tokens=False)
    assert (mapped.params.max_tokens, mapped.params.seed, mapped.params.n) == (12, 5, 1)
    assert mapped.response_fields is not None and mapped.response_fields["instructions"] == "Be brief."
    plain = map_request(RESPONSES, {"model": "m", "input": "Capital of France?"}, served_tokenizer)
    chat = map_request(
        CHAT_COMPLETIONS,
        {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}]},
        served_tokenizer,
    )
    assert plain.prompt_token_ids == chat.prompt_token_ids and plain.params.max_tokens is None

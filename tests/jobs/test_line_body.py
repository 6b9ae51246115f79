"""Line bodies judged by their endpoint's schema (`jobs.line_body.parse_body`): plain messages naming
``param``, and the engine's `SamplingParams` arguments (`sampling_kwargs`)."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.errors import InvalidRequest
from jobs.line_body import parse_body
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES

MODEL = "SmolLM2-135M-Instruct"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def _response(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Say hi.", **fields}


def _rejection(endpoint: str, body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_body(endpoint, body)
    return info.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"logprobs": 3}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"42": 101}}, "logit_bias.42"),
        ({"seed": "7"}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stream": True}, "stream"),
        ({"functions": []}, "functions"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_chat_body_out_of_range_or_unknown_field_names_the_field(fields: dict[str, Any], param: str) -> None:
    error = _rejection(CHAT_COMPLETIONS, _chat(**fields))
    assert (error.param, error.code) == (param, "invalid_value")
    assert error.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"prompt": ""},
            "prompt",
            "prompt: must be a non-empty string or a non-empty list of token ids (integers >= 0)",
        ),
        (
            {"prompt": []},
            "prompt",
            "prompt: must be a non-empty string or a non-empty list of token ids (integers >= 0)",
        ),
        (
            {"prompt": [1, -1]},
            "prompt",
            "prompt: must be a non-empty string or a non-empty list of token ids (integers >= 0)",
        ),
        ({"prompt": ["a", "b"]}, "prompt", "put each prompt on its own line"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: must be greater than or equal to 1"),
        ({"temperature": -1}, "temperature", "temperature: must be greater than or equal to 0"),
        ({"logprobs": 21}, "logprobs", "logprobs: must be less than or equal to 20"),
        ({"logprobs": True}, "logprobs", "logprobs: must be a valid integer"),
        ({"suffix": "y"}, "suffix", "suffix: unknown field (not a parameter of /v1/completions)"),
        ({"min_tokens": 17}, "min_tokens", "min_tokens: must be <= the max tokens (16), got 17"),
        ({"stream": True}, "stream", "stream: streaming is not supported in a batch"),
        ({"stop": ["a", 1]}, "stop", "stop: must be a string or a list of strings"),
    ],
)
def test_completion_body_errors_are_plain_words(fields: dict[str, Any], param: str, message: str) -> None:
    error = _rejection(COMPLETIONS, _completion(**fields))
    assert error.param == param
    assert message in error.message
    assert "Input should" not in error.message and "Value error" not in error.message


def test_beam_search_options_reach_the_engine() -> None:
    body = _completion(use_beam_search=True, n=4, length_penalty=0.6, early_stopping=True, temperature=0)
    kwargs = parse_body(COMPLETIONS, body).sampling_kwargs()
    assert kwargs["use_beam_search"] and kwargs["n"] == 4
    assert (kwargs["length_penalty"], kwargs["early_stopping"], kwargs["temperature"]) == (0.6, True, 0.0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"stop": ["\n"]}, "stop"),
        ({"logit_bias": {"42": 1.0}}, "logit_bias"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 5}, "best_of"),
        ({"presence_penalty": 0.5, "stop": "x"}, "presence_penalty"),
    ],
)
def test_beam_search_refuses_what_it_would_ignore(fields: dict[str, Any], param: str) -> None:
    error = _rejection(COMPLETIONS, _completion(use_beam_search=True, n=4, **fields))
    assert error.param == param and "not supported with use_beam_search" in error.message


def test_best_of_must_be_at_least_n() -> None:
    error = _rejection(COMPLETIONS, _completion(n=3, best_of=2, temperature=0.8))
    assert error.param == "best_of" and "must be >= n (3)" in error.message
    assert parse_body(COMPLETIONS, _completion(n=3, best_of=5)).sampling_kwargs()["best_of"] == 5
    assert _rejection(CHAT_COMPLETIONS, _chat(best_of=2)).param == "best_of"  # completions only, as OpenAI


def test_missing_model_and_unknown_endpoint() -> None:
    body = _chat()
    del body["model"]
    assert _rejection(CHAT_COMPLETIONS, body).param == "model"
    assert _rejection("/v1/moderations", {"input": "x"}).param == "url"


def test_chat_body_accepts_every_contract_field_and_vllm_extension() -> None:
    body = _chat(
        max_tokens=8,
        max_completion_tokens=6,
        temperature=0.7,
        top_p=0.9,
        n=2,
        stop=["\n", "END"],
        seed=3,
        logprobs=True,
        top_logprobs=20,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"42": -100, "7": 100},
        user="u1",
        stream=False,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[2],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        use_beam_search=False,
        length_penalty=1.0,
        early_stopping=False,
    )
    body["messages"] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}],
            "name": "ann",
        },
        {"role": "assistant", "content": "Hello.", "refusal": None},
        {"role": "developer", "content": "Answer in French."},
        {"role": "assistant", "content": "Non.", "refusal": "I cannot."},
    ]
    parsed = parse_body(CHAT_COMPLETIONS, body)
    assert parsed.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "assistant", "content": "Non."},
    ]
    assert parsed.sampling_kwargs() == {
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 2,
        "stop": ["\n", "END"],
        "seed": 3,
        "logprobs": 20,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {42: -100.0, 7: 100.0},
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "early_stopping": False,
    }


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"n": 1, "max_tokens": 16}),
        ({"prompt": ["Once"], "stop": ""}, {"n": 1, "max_tokens": 16, "stop": []}),
        ({"prompt": [1, 2, 3], "logprobs": 0}, {"n": 1, "max_tokens": 16, "logprobs": 0}),
        (
            {"echo": True, "logprobs": 5, "max_tokens": 4, "stop": "\n"},
            {"n": 1, "max_tokens": 4, "stop": ["\n"], "logprobs": 5, "prompt_logprobs": 5},
        ),
    ],
)
def test_completion_sampling_kwargs(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    assert parse_body(COMPLETIONS, _completion(**fields)).sampling_kwargs() == expected


def test_chat_defaults_leave_max_tokens_to_the_context() -> None:
    assert parse_body(CHAT_COMPLETIONS, _chat()).sampling_kwargs() == {"n": 1, "max_tokens": None}
    assert parse_body(CHAT_COMPLETIONS, _chat(logprobs=True)).sampling_kwargs()["logprobs"] == 0


@pytest.mark.parametrize("depth", [70, 990, 5000])
def test_a_deeply_nested_body_is_a_400_not_a_recursion_error(depth: int) -> None:
    """A stored body is at most 63 levels deep (validation caps the line at 64); a deeper one (stored
    before the cap, or built by hand) is refused like any bad body, whatever the caller's stack depth."""
    nested: Any = 1
    for _ in range(depth):
        nested = [nested]
    error = _rejection(CHAT_COMPLETIONS, _chat(user=nested))
    assert error.message == "the body nests arrays and objects more than 63 levels deep"
    assert (error.param, error.code) == (None, "invalid_value")


def test_the_assistant_message_this_service_writes_is_accepted_back_as_history() -> None:
    """Output choices carry ``{role, content, refusal: null}``; fed back as a turn, it parses (the refusal
    is not part of the prompt)."""
    written = {"role": "assistant", "content": "Paris", "refusal": None}
    body = _chat(messages=[{"role": "user", "content": "Capital of France?"}, written])
    assert parse_body(CHAT_COMPLETIONS, body).conversation()[1] == {"role": "assistant", "content": "Paris"}


@pytest.mark.parametrize(
    ("message", "param", "text"),
    [
        ({"role": "user", "content": None}, "messages[0].content", "must not be null"),
        ({"role": "system", "content": None}, "messages[0].content", "must not be null"),
        ({"role": "assistant", "content": None}, "messages[0].content", "must not be null"),
        ({"role": "user"}, "messages[0].content", "is required"),
        ({"role": "user", "content": "Hi", "refusal": None}, "messages[0].refusal", "only assistant messages"),
        ({"role": "assistant", "content": "Hi", "refusal": 3}, "messages[0].refusal", "must be a valid string"),
    ],
)
def test_null_or_missing_content_and_a_misplaced_refusal_are_400s(
    message: dict[str, Any], param: str, text: str
) -> None:
    error = _rejection(CHAT_COMPLETIONS, _chat(messages=[message]))
    assert error.param == param
    assert text in error.message


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        (CHAT_COMPLETIONS, "store", False),
        (CHAT_COMPLETIONS, "stream_options", None),
        (CHAT_COMPLETIONS, "metadata", {}),
        (CHAT_COMPLETIONS, "tools", []),
        (CHAT_COMPLETIONS, "tool_choice", "none"),
        (CHAT_COMPLETIONS, "parallel_tool_calls", False),
        (CHAT_COMPLETIONS, "functions", []),
        (CHAT_COMPLETIONS, "function_call", "none"),
        (CHAT_COMPLETIONS, "audio", None),
        (CHAT_COMPLETIONS, "modalities", ["text"]),
        (CHAT_COMPLETIONS, "prediction", None),
        (CHAT_COMPLETIONS, "reasoning_effort", "low"),
        (CHAT_COMPLETIONS, "verbosity", "low"),
        (CHAT_COMPLETIONS, "service_tier", "auto"),
        (CHAT_COMPLETIONS, "web_search_options", {}),
        (CHAT_COMPLETIONS, "prompt_cache_key", "k"),
        (CHAT_COMPLETIONS, "safety_identifier", "s"),
        (COMPLETIONS, "suffix", "x"),
        (COMPLETIONS, "stream_options", None),
        (COMPLETIONS, "response_format", {"type": "json_object"}),
        (RESPONSES, "tools", []),
        (RESPONSES, "tool_choice", "none"),
        (RESPONSES, "parallel_tool_calls", False),
        (RESPONSES, "max_tool_calls", 1),
        (RESPONSES, "reasoning", {"effort": "low"}),
        (RESPONSES, "include", []),
        (RESPONSES, "previous_response_id", "resp_1"),
        (RESPONSES, "conversation", "conv_1"),
        (RESPONSES, "background", False),
        (RESPONSES, "prompt", {"id": "pmpt_1"}),
        (RESPONSES, "truncation", "disabled"),
        (RESPONSES, "top_logprobs", 2),
        (RESPONSES, "service_tier", "auto"),
        (RESPONSES, "stream_options", None),
        (RESPONSES, "prompt_cache_key", "k"),
        (RESPONSES, "safety_identifier", "s"),
        (RESPONSES, "max_tokens", 5),
        (RESPONSES, "n", 2),
    ],
)
def test_openai_fields_docs_list_as_refused_are_refused_by_name(endpoint: str, field: str, value: Any) -> None:
    """docs/api.md, "Deviations from OpenAI": each of these is a per-line 400 naming the field."""
    body = {CHAT_COMPLETIONS: _chat, COMPLETIONS: _completion, RESPONSES: _response}[endpoint]()
    error = _rejection(endpoint, {**body, field: value})
    assert error.param == field
    assert "unknown field" in error.message


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (CHAT_COMPLETIONS, _chat(messages=[{"role": "user", "content": "hi\x00"}]), "messages[0].content"),
        (
            CHAT_COMPLETIONS,
            _chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "\ud800"}]),
            "messages[1].content",
        ),
        (CHAT_COMPLETIONS, _chat(stop=["ok", "\udfff"]), "stop[1]"),
        (COMPLETIONS, _completion(prompt="x\x00y"), "prompt"),
        (COMPLETIONS, _completion(logit_bias={"1\x00": 1}), "logit_bias.1\\u0000"),
        (COMPLETIONS, _completion(**{"\ud83d": 1}), "\\ud83d"),
    ],
)
def test_a_nul_or_lone_surrogate_anywhere_in_a_body_is_a_400_naming_the_field(
    endpoint: str, body: dict[str, Any], param: str
) -> None:
    error = _rejection(endpoint, body)
    assert error.param == param
    assert ("NUL character" in error.message) != ("lone surrogate" in error.message)
    assert "\x00" not in error.message and "\ud800" not in error.message  # written as its JSON escape


def _parts(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize(
    ("endpoint", "messages", "param", "text"),
    [
        (RESPONSES, _parts({"type": "input_text", "text": "x", "foo": 1}), "input[0].content[0].foo", "unknown field"),
        (RESPONSES, [{"role": "user", "content": None}], "input[0].content", "must not be null"),
        (RESPONSES, [{"role": "user"}], "input[0].content", "is required"),
        (
            RESPONSES,
            _parts({"type": "text", "text": "x"}),
            "input[0].content[0].type",
            "'text' is not one of 'input_text' or 'output_text'",
        ),
        (RESPONSES, [{"role": "user", "content": []}], "input[0].content", "must not be empty"),
        (RESPONSES, [{"role": "user", "content": 5}], "input[0].content", "must be a string or a non-empty list"),
        (RESPONSES, _parts({"type": "input_text"}), "input[0].content[0].text", "is required"),
        (
            RESPONSES,
            [{"role": "user", "content": "ok"}, *_parts({"type": "output_text", "text": "x"}, {"type": "input_file"})],
            "input[1].content[1].type",
            "'input_file' is not one of",
        ),
        (
            CHAT_COMPLETIONS,
            _parts({"type": "text", "text": "x", "foo": 1}),
            "messages[0].content[0].foo",
            "unknown field",
        ),
        (CHAT_COMPLETIONS, [{"role": "user", "content": None}], "messages[0].content", "must not be null"),
        (CHAT_COMPLETIONS, _parts({"type": "input_text", "text": "x"}), "messages[0].content[0].type", "is not 'text'"),
        (CHAT_COMPLETIONS, [{"role": "user", "content": []}], "messages[0].content", "must not be empty"),
    ],
)
def test_a_bad_content_part_is_named_by_its_place(
    endpoint: str, messages: list[dict[str, Any]], param: str, text: str
) -> None:
    body = _response(input=messages) if endpoint == RESPONSES else _chat(messages=messages)
    error = _rejection(endpoint, body)
    assert error.param == param, error.message
    assert text in error.message


@pytest.mark.parametrize("endpoint", [RESPONSES, CHAT_COMPLETIONS])
def test_string_content_and_text_parts_give_the_same_conversation(endpoint: str) -> None:
    part_type = "input_text" if endpoint == RESPONSES else "text"
    as_parts = [{"role": "user", "content": [{"type": part_type, "text": "Say "}, {"type": part_type, "text": "hi."}]}]
    as_string = [{"role": "user", "content": "Say hi."}]

    def conversation(messages: list[dict[str, Any]]) -> Any:
        body = _response(input=messages) if endpoint == RESPONSES else _chat(messages=messages)
        return parse_body(endpoint, body).conversation()  # type: ignore[union-attr]

    assert conversation(as_parts) == conversation(as_string) == [{"role": "user", "content": "Say hi."}]

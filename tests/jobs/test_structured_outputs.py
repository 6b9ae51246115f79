"""Structured outputs and Responses lines as the body parse judges them (`jobs.line_body.parse_body`):
every bad input a per-line 400 naming its field, every good one its `Constraint` (docs/api.md,
"Structured outputs" and "Responses lines")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jobs.errors import InvalidRequest
from jobs.line_body import parse_body
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES
from jobs.structured_outputs import Constraint, strict_schema_problem

MODEL = "SmolLM2-135M-Instruct"
LABEL = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative"]}, "score": {"type": "number"}},
    "required": ["label", "score"],
    "additionalProperties": False,
}
NOT_A_SCHEMA = {"type": "objekt"}
NOT_STRICT = {"type": "object", "properties": {"label": {"type": "string"}}}


def _body(endpoint: str, **fields: Any) -> dict[str, Any]:
    prompt = {
        CHAT_COMPLETIONS: {"messages": [{"role": "user", "content": "Label this."}]},
        COMPLETIONS: {"prompt": "Label this:"},
        RESPONSES: {"input": "Label this."},
    }[endpoint]
    return {"model": MODEL, **prompt, **fields}


def _json_schema_format(schema: Any = LABEL, **fields: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "label", "schema": schema, **fields}}


def _text_format(**fields: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "label", "schema": LABEL, **fields}}


# Each bad input, the field its 400 names, and words its message must hold.
BAD_INPUTS = [
    # chat response_format
    (CHAT_COMPLETIONS, {"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
    (CHAT_COMPLETIONS, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    (
        CHAT_COMPLETIONS,
        {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": LABEL}}},
        "response_format.json_schema",
        'only taken with "type": "json_schema"',
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "label"}}},
        "response_format.json_schema.schema",
        "is required",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": _json_schema_format(NOT_A_SCHEMA)},
        "response_format.json_schema.schema",
        "is not a valid JSON Schema",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": _json_schema_format([LABEL])},
        "response_format.json_schema.schema",
        "must be a valid dictionary",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "my label", "schema": LABEL}}},
        "response_format.json_schema.name",
        "a-z, A-Z, 0-9, _ and -",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": _json_schema_format(NOT_STRICT, strict=True)},
        "response_format.json_schema.schema",
        "additionalProperties",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": _json_schema_format({"type": "array", "items": {"type": "string"}}, strict=True)},
        "response_format.json_schema.schema",
        'the root must be an object ("type": "object"), not "type": "array"',
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": _json_schema_format(strict="yes")},
        "response_format.json_schema.strict",
        "must be a valid boolean",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": {"type": "structural_tag", "structures": []}},
        "response_format.type",
        "must be 'text'",
    ),
    (
        CHAT_COMPLETIONS,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
        "structured_outputs",
        "cannot be combined with response_format",
    ),
    # vLLM's structured_outputs, on both of its endpoints
    (COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one string"),
    (CHAT_COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one string"),
    (COMPLETIONS, {"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "valid string"),
    (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs", "exactly one of json, regex"),
    (COMPLETIONS, {"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "got regex, choice"),
    (COMPLETIONS, {"structured_outputs": {"json": NOT_A_SCHEMA}}, "structured_outputs.json", "not a valid JSON Schema"),
    (COMPLETIONS, {"structured_outputs": {"json": "{bad"}}, "structured_outputs.json", "not valid JSON text"),
    (COMPLETIONS, {"structured_outputs": {"json": 3}}, "structured_outputs.json", "must be a JSON Schema object"),
    (COMPLETIONS, {"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "at least 1 character"),
    (COMPLETIONS, {"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "valid string"),
    (
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
        "unknown field",
    ),
    (COMPLETIONS, {"structured_outputs": "a|b"}, "structured_outputs", "valid dictionary"),
    # vLLM's older guided_* fields
    (COMPLETIONS, {"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    (COMPLETIONS, {"guided_json": NOT_A_SCHEMA}, "guided_json", "not a valid JSON Schema"),
    (COMPLETIONS, {"guided_grammar": ""}, "guided_grammar", "non-empty string"),
    (
        COMPLETIONS,
        {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
        "guided_regex",
        "cannot be combined with structured_outputs",
    ),
    (CHAT_COMPLETIONS, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined"),
    (COMPLETIONS, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unknown field"),
    # Responses text.format
    (RESPONSES, {"text": {"format": {"type": "json_schema", "schema": LABEL}}}, "text.format.name", "is required"),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "is required"),
    (RESPONSES, {"text": _text_format(schema=NOT_A_SCHEMA)}, "text.format.schema", "not a valid JSON Schema"),
    (
        RESPONSES,
        {"text": _text_format(schema={"type": "array", "items": {"type": "string"}}, strict=True)},
        "text.format.schema",
        'the root must be an object ("type": "object"), not "type": "array"',
    ),
    (RESPONSES, {"text": {"format": {"type": "text", "schema": LABEL}}}, "text.format.schema", "only taken with"),
    (RESPONSES, {"text": {"format": {"type": "json"}}}, "text.format.type", "must be 'text'"),
    (RESPONSES, {"text": {"verbosity": "low"}}, "text.verbosity", "unknown field"),
    # Responses input and fields not served
    (RESPONSES, {"input": ""}, "input", "non-empty string or a non-empty list of messages"),
    (RESPONSES, {"input": []}, "input", "non-empty string or a non-empty list of messages"),
    (RESPONSES, {"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be 'system'"),
    (
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        "input[0].content[0].type",
        "'input_image' is not one of 'input_text' or 'output_text': only text parts are served (images, files",
    ),
    (
        RESPONSES,
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]},
        "input[0].type",
        "must be 'message'",
    ),
    (RESPONSES, {"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    (RESPONSES, {"temperature": 3}, "temperature", "less than or equal to 2"),
    (RESPONSES, {"top_p": 0}, "top_p", "greater than 0"),
    (RESPONSES, {"seed": 1.5}, "seed", "valid integer"),
    (RESPONSES, {"stream": True}, "stream", "streaming is not supported"),
    (RESPONSES, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
    (RESPONSES, {"metadata": {"k": 1}}, "metadata.k", "valid string"),
    (RESPONSES, {"store": "no"}, "store", "valid boolean"),
    (RESPONSES, {"tools": [{"type": "web_search"}]}, "tools", "unknown field (not served on /v1/responses"),
    (RESPONSES, {"reasoning": {"effort": "low"}}, "reasoning", "unknown field"),
    (RESPONSES, {"previous_response_id": "resp_1"}, "previous_response_id", "unknown field"),
    (RESPONSES, {"background": True}, "background", "unknown field"),
    (RESPONSES, {"include": ["message.output_text.logprobs"]}, "include", "unknown field"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param", "words"), BAD_INPUTS)
def test_each_bad_input_is_a_400_naming_its_field(
    endpoint: str, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(endpoint, _body(endpoint, **fields))
    error = info.value
    assert (error.param, error.code) == (param, "invalid_value"), error.message
    assert error.message.startswith(f"{param}: ") and words in error.message, error.message
    assert "Input should" not in error.message and "Value error" not in error.message


@pytest.mark.parametrize(
    ("endpoint", "fields", "expected"),
    [
        (CHAT_COMPLETIONS, {}, None),
        (CHAT_COMPLETIONS, {"response_format": {"type": "text"}}, None),
        (CHAT_COMPLETIONS, {"response_format": {"type": "json_object"}}, ({"json_object": True}, "response_format")),
        (
            CHAT_COMPLETIONS,
            {"response_format": _json_schema_format(strict=True, description="a sentiment label")},
            ({"json": LABEL}, "response_format.json_schema.schema"),
        ),
        (
            CHAT_COMPLETIONS,
            {"response_format": _json_schema_format(NOT_STRICT, strict=False)},
            ({"json": NOT_STRICT}, "response_format.json_schema.schema"),
        ),
        (
            CHAT_COMPLETIONS,
            {"response_format": {"type": "text"}, "structured_outputs": {"choice": ["yes", "no"]}},
            ({"choice": ("yes", "no")}, "structured_outputs.choice"),
        ),
        (COMPLETIONS, {"structured_outputs": {"regex": r"\d{3}"}}, ({"regex": r"\d{3}"}, "structured_outputs.regex")),
        (COMPLETIONS, {"structured_outputs": {"json": LABEL}}, ({"json": LABEL}, "structured_outputs.json")),
        (
            COMPLETIONS,
            {"structured_outputs": {"json": json.dumps(LABEL)}},
            ({"json": LABEL}, "structured_outputs.json"),
        ),
        (
            CHAT_COMPLETIONS,
            {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
            ({"grammar": 'root ::= "yes" | "no"'}, "structured_outputs.grammar"),
        ),
        (
            COMPLETIONS,
            {"structured_outputs": {"json_object": True, "regex": None}},
            ({"json_object": True}, "structured_outputs.json_object"),
        ),
        (COMPLETIONS, {"guided_choice": ["a", "b"]}, ({"choice": ("a", "b")}, "guided_choice")),
        (COMPLETIONS, {"guided_json": json.dumps(LABEL)}, ({"json": LABEL}, "guided_json")),
        (CHAT_COMPLETIONS, {"guided_regex": "[ab]+"}, ({"regex": "[ab]+"}, "guided_regex")),
        (COMPLETIONS, {"guided_grammar": 'root ::= "x"'}, ({"grammar": 'root ::= "x"'}, "guided_grammar")),
        (RESPONSES, {}, None),
        (RESPONSES, {"text": {"format": {"type": "text"}}}, None),
        (RESPONSES, {"text": {"format": {"type": "json_object"}}}, ({"json_object": True}, "text.format")),
        (RESPONSES, {"text": _text_format(strict=True)}, ({"json": LABEL}, "text.format.schema")),
    ],
)
def test_the_constraint_each_body_asks_for(
    endpoint: str, fields: dict[str, Any], expected: tuple[dict[str, Any], str] | None
) -> None:
    parsed = parse_body(endpoint, _body(endpoint, **fields))
    assert parsed.constraint == (None if expected is None else Constraint(*expected))
    assert "structured_outputs" not in parsed.sampling_kwargs()


def test_a_pattern_is_left_to_the_grammar_engine() -> None:
    """A ``pattern`` Python's ``re`` cannot compile (``\\p{L}``) passes the body parse: the grammar engine's
    regex dialect judges it when the line joins the engine; a pattern that is not a string still fails."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "pattern": r"^\p{L}+$"}}}
    parsed = parse_body(COMPLETIONS, _body(COMPLETIONS, structured_outputs={"json": schema}))
    assert parsed.constraint == Constraint({"json": schema}, "structured_outputs.json")
    with pytest.raises(InvalidRequest) as info:
        parse_body(COMPLETIONS, _body(COMPLETIONS, structured_outputs={"json": {"type": "string", "pattern": 3}}))
    assert info.value.param == "structured_outputs.json" and "(at pattern)" in info.value.message


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = _object(inner=schema)
    return schema


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (LABEL, None),
        (_nested(10), None),
        (_nested(11), "nested more than 10 levels"),
        ({"type": "array", "items": LABEL}, 'the root must be an object ("type": "object"), not "type": "array"'),
        ({"type": ["object", "null"], "properties": {}}, 'not "type": ["object", "null"]'),
        ({"type": "string"}, 'not "type": "string"'),
        ({"properties": {}, "additionalProperties": False}, 'it has no "type"'),
        ({"anyOf": [LABEL], "type": "object"}, "not an anyOf"),
        ({"anyOf": [LABEL]}, "not an anyOf"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            '"additionalProperties": false',
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
            "(missing: a)",
        ),
        (_object(items={"type": "array", "items": {"type": "object", "properties": {}}}), "#/properties/items/items"),
        (_object(choice={"anyOf": [{"type": "string"}, {"type": "object"}]}), "#/properties/choice/anyOf/1"),
        ({**_object(a={"$ref": "#/$defs/x"}), "$defs": {"x": {"type": "object", "properties": {}}}}, "#/$defs/x"),
        (_object(**{f"p{i}": {"type": "string"} for i in range(5001)}), "5001 object properties"),
        (_object(a={"enum": list(range(600))}, b={"enum": list(range(401))}), "1001 enum values"),
        (_object(a={"enum": [f"{i:060d}" for i in range(251)]}), "the enum at #/properties/a has 251 values"),
        (
            _object(**{f"p{i}": {"const": "x" * 1000} for i in range(121)}),
            "characters (at most 120000)",
        ),
    ],
)
def test_openais_strict_rules(schema: dict[str, Any], problem: str | None) -> None:
    found = strict_schema_problem(schema)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_a_responses_body_is_a_chat_conversation_with_its_fields_echoed() -> None:
    body = _body(
        RESPONSES,
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Paris", "annotations": []}],
            },
            {"role": "user", "content": "And of Italy?"},
        ],
        instructions="Be brief.",
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        seed=4,
        metadata={"topic": "capitals"},
        store=False,
        user="u1",
        text=_text_format(strict=True),
    )
    parsed = parse_body(RESPONSES, body)
    assert parsed.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert parsed.sampling_kwargs() == {"n": 1, "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 4}
    assert parsed.echoed_fields() == {
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "metadata": {"topic": "capitals"},
        "temperature": 0.5,
        "top_p": 0.9,
        "text": {"format": {"type": "json_schema", "name": "label", "strict": True, "schema": LABEL}},
        "user": "u1",
    }


def test_a_plain_responses_body_takes_openais_defaults() -> None:
    parsed = parse_body(RESPONSES, _body(RESPONSES))
    assert parsed.conversation() == [{"role": "user", "content": "Label this."}]
    assert parsed.sampling_kwargs() == {"n": 1, "max_tokens": None}
    echoed = parsed.echoed_fields()
    assert (echoed["temperature"], echoed["top_p"], echoed["metadata"]) == (1.0, 1.0, {})
    assert echoed["text"] == {"format": {"type": "text"}} and echoed["instructions"] is None

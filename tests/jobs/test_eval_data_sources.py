"""`jobs.evals.data_sources`: data sources parsed once, item lines rendered, samples read back."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.errors import InvalidRequest
from jobs.evals.data_sources import check_template_fields, line_body, parse_data_source, samples_from_response
from jobs.evals.templates import TemplateError

MODEL = "served"
SCHEMA = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "meta": {"type": "object", "properties": {"lang": {"type": "string"}}}},
}


def _completions(**overrides: Any) -> dict[str, Any]:
    return {
        "type": "completions",
        "source": {"type": "file_content", "content": [{"item": {"q": "x"}}]},
        "input_messages": {
            "type": "template",
            "template": [
                {"role": "system", "content": {"type": "input_text", "text": "Reply in {{item.meta.lang}}."}},
                {"role": "user", "content": "{{item.q}}"},
            ],
        },
        "sampling_params": {"temperature": 0.5, "n": 2, "max_completion_tokens": 4},
        **overrides,
    }


def test_a_template_line_renders_nested_fields_and_carries_the_sampling_params() -> None:
    data_source = parse_data_source(_completions(), item_schema=SCHEMA, served_model=MODEL)
    body = line_body(data_source, {"q": "2+2?", "meta": {"lang": "French"}})
    assert body == {
        "model": MODEL,
        "temperature": 0.5,
        "n": 2,
        "max_completion_tokens": 4,
        "messages": [{"role": "system", "content": "Reply in French."}, {"role": "user", "content": "2+2?"}],
    }
    with pytest.raises(TemplateError, match=r"item\.meta"):
        line_body(data_source, {"q": "2+2?"})


def test_template_fields_are_checked_against_the_schema_properties() -> None:
    check_template_fields("{{item.meta.lang}} {{sample.output_text}}", SCHEMA, param="p")
    check_template_fields("{{item.anything}}", {"type": "object"}, param="p")  # no properties: any field
    with pytest.raises(InvalidRequest, match=r"item\.meta\.country") as raised:
        check_template_fields("{{item.meta.country}}", SCHEMA, param="p")
    assert raised.value.param == "p"


def test_samples_are_one_per_choice_or_the_responses_output_text() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = {
        "model": MODEL,
        "usage": usage,
        "choices": [
            {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
            for i, text in enumerate(["a", "b"])
        ],
    }
    samples = samples_from_response("/v1/chat/completions", chat)
    assert [s["output_text"] for s in samples] == ["a", "b"] and samples[1]["choices"][0]["index"] == 1
    assert all(s["model"] == MODEL and s["usage"] == usage for s in samples)
    response = {
        "model": MODEL,
        "output": [
            {"type": "reasoning", "content": []},
            {
                "type": "message",
                "content": [{"type": "output_text", "text": "he"}, {"type": "output_text", "text": "llo"}],
            },
        ],
    }
    assert [s["output_text"] for s in samples_from_response("/v1/responses", response)] == ["hello"]


def test_an_item_reference_must_name_a_list_of_messages() -> None:
    data_source = parse_data_source(
        _completions(input_messages={"type": "item_reference", "item_reference": "item.q"}),
        item_schema={"type": "object"},
        served_model=MODEL,
    )
    assert line_body(data_source, {"q": [{"role": "user", "content": "hi"}]})["messages"] == [
        {"role": "user", "content": "hi"}
    ]
    with pytest.raises(TemplateError, match="list of messages"):
        line_body(data_source, {"q": "hi"})

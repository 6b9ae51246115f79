"""Structured outputs end to end: API and worker (the real engine on SmolLM2) as child processes (the shared
stack of tests/e2e/served/conftest.py), driven through the `openai` SDK, as in tests/e2e/served/test_service_e2e.py.

A chat batch whose lines carry a ``json_schema`` built by the SDK from a pydantic model (the
``response_format`` ``client.chat.completions.parse`` would send): every answer that finished (``stop``)
validates against the schema and loads into the model, greedy and sampled. ``choice`` and ``regex``
lines keep to their constraint; a grammar the engine cannot compile fails its line alone, naming
``structured_outputs.grammar``. A ``/v1/responses`` batch with ``text.format`` from the same model reads
back with the SDK's ``Response`` and its ``output_text`` loads into the model.

Needs the grammar engine (`worker.engine.structured_output`), hence the skip when it is absent.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("worker.engine.structured_output")

import jsonschema
from openai.lib._parsing._completions import type_to_response_format_param
from openai.types.responses import Response

from examples.classify import SYSTEM, ReviewLabel, reviews
from jobs.config import BUILTIN_MODEL
from tests.e2e.served.test_service_e2e import _read, _run

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

MAX_TOKENS = 96
CHOICES = ["positive", "negative", "neutral"]
YEAR = r"(19|20)[0-9]{2}"


def _chat_line(custom_id: str, review: str, **body) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": BUILTIN_MODEL, "messages": messages, "max_tokens": MAX_TOKENS, **body},
    }


def _finished_answers(envelope: dict) -> list[str]:
    """The texts of the choices that finished with ``stop`` (a ``length`` answer is cut, as at OpenAI)."""
    assert envelope["response"]["status_code"] == 200, envelope
    return [c["message"]["content"] for c in envelope["response"]["body"]["choices"] if c["finish_reason"] == "stop"]


def test_a_chat_batch_with_a_pydantic_json_schema_loads_every_answer_into_the_model(service):
    client, logs = service
    response_format = type_to_response_format_param(ReviewLabel)
    schema = response_format["json_schema"]["schema"]
    texts = reviews()[:16]
    lines = [
        _chat_line(f"greedy-{i}", text, temperature=0, response_format=response_format)
        for i, text in enumerate(texts[:10])
    ]
    lines += [
        _chat_line(f"sampled-{i}", text, temperature=1.0, seed=i, n=2, response_format=response_format)
        for i, text in enumerate(texts[10:])
    ]
    lines += [
        _chat_line("choice", texts[0], temperature=0, structured_outputs={"choice": CHOICES}),
        _chat_line(
            "regex", "In which year did the first iPhone come out?", temperature=0, structured_outputs={"regex": YEAR}
        ),
        _chat_line("bad-grammar", texts[1], structured_outputs={"grammar": 'root ::= ("a" | '}),
    ]

    batch = _run(client, logs, lines, "/v1/chat/completions", timeout_s=1200)

    assert batch.status == "completed"
    output, errors = _read(client, batch.output_file_id), _read(client, batch.error_file_id)
    assert set(errors) == {"bad-grammar"}, errors
    error = errors["bad-grammar"]["response"]["body"]["error"]
    assert (error["param"], error["code"]) == ("structured_outputs.grammar", "invalid_value")
    assert set(output) == {line["custom_id"] for line in lines} - {"bad-grammar"}

    num_choices = num_finished = 0
    for custom_id, envelope in output.items():
        if custom_id in ("choice", "regex"):
            continue
        num_choices += len(envelope["response"]["body"]["choices"])
        for answer in _finished_answers(envelope):
            jsonschema.validate(json.loads(answer), schema)
            label = ReviewLabel.model_validate_json(answer)
            assert 1 <= label.stars <= 5
            num_finished += 1
    assert num_choices == 10 + 6 * 2
    # NOTE: an answer may run out of max_tokens (then it is cut and not checked); most must finish.
    assert num_finished >= 0.9 * num_choices, (num_finished, num_choices)
    assert _finished_answers(output["choice"]) and all(a in CHOICES for a in _finished_answers(output["choice"]))
    regex_answers = _finished_answers(output["regex"])
    assert regex_answers and all(re.fullmatch(YEAR, a) for a in regex_answers), regex_answers


def test_a_responses_batch_with_text_format_loads_output_text_into_the_model(service):
    client, logs = service
    text_format = type_to_response_format_param(ReviewLabel)["json_schema"]
    lines = [
        {
            "custom_id": f"review-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": BUILTIN_MODEL,
                "instructions": SYSTEM,
                "input": text,
                "max_output_tokens": MAX_TOKENS,
                "temperature": 0,
                "text": {"format": {"type": "json_schema", **text_format}},
            },
        }
        for i, text in enumerate(reviews()[:6])
    ]

    batch = _run(client, logs, lines, "/v1/responses", timeout_s=600)

    assert batch.status == "completed" and batch.error_file_id is None
    output = _read(client, batch.output_file_id)
    completed = 0
    for envelope in output.values():
        response = Response.model_validate(envelope["response"]["body"])
        assert response.text is not None and response.text.format is not None
        assert response.text.format.type == "json_schema"
        if response.status == "completed":
            ReviewLabel.model_validate_json(response.output_text)
            completed += 1
    assert completed >= 5, completed

"""Structured outputs and Responses lines through the runner: validation, the worker's parse, the
stand-in engine (tests/helpers/stand_in_engine.py) and the output and error files, on a real (SQLite)
database. A bad line is a 400 naming its line and field while its neighbours complete; an engine that
cannot compile a constraint fails its line naming the body field the constraint came from."""

from __future__ import annotations

from typing import Any

import pytest

from jobs import intake, repository
from jobs.config import BUILTIN_MODEL, get_settings
from jobs.db import session_scope
from jobs.files import write_file
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES
from jobs.status import BatchStatus
from tests.helpers.service import jsonl
from tests.helpers.stand_in_engine import StandInEngine, run_batch
from tests.jobs.test_structured_outputs import BAD_INPUTS, LABEL
from tests.worker.test_runner import make_batch, read_results, service  # noqa: F401  (fixture)
from worker.engine.errors import InvalidParameterError

_PROMPTS = {
    CHAT_COMPLETIONS: {"messages": [{"role": "user", "content": "Label: a fine film."}]},
    COMPLETIONS: {"prompt": "Label: a fine film."},
    RESPONSES: {"input": "Label: a fine film."},
}


def _line(custom_id: str, endpoint: str, **fields: Any) -> dict[str, Any]:
    body = {"model": BUILTIN_MODEL, **_PROMPTS[endpoint], "temperature": 0, **fields}
    if endpoint == RESPONSES:
        body.setdefault("max_output_tokens", 3)
    else:
        body.setdefault("max_tokens", 3)
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}


def _validated_batch(lines: list[dict[str, Any]], endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A batch of ``lines`` through the API's validation, as the API leaves it for a worker."""
    with session_scope() as session:
        file = write_file(session, chunks=[jsonl(lines)], filename="in.jsonl", purpose="batch")
        batch_id = repository.create_batch(session, input_file_id=file.id, endpoint=endpoint).id
    monkeypatch.setattr(intake, "enqueue_shards", lambda *args, **kwargs: 0)
    assert intake.validate_and_start(batch_id, settings=get_settings()) == BatchStatus.IN_PROGRESS
    return batch_id


@pytest.mark.parametrize("endpoint", [CHAT_COMPLETIONS, COMPLETIONS, RESPONSES])
def test_every_bad_structured_input_is_a_400_for_its_line_alone(service, served_tokenizer, monkeypatch, endpoint):
    """One batch per endpoint: a good line (constrained) between every two bad ones of the table in
    tests/jobs/test_structured_outputs.py; each bad line's 400 names its line number and its field."""
    bad = [(fields, param) for bad_endpoint, fields, param, _ in BAD_INPUTS if bad_endpoint == endpoint]
    good_fields = {
        CHAT_COMPLETIONS: {"response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": LABEL}}},
        COMPLETIONS: {"structured_outputs": {"choice": ["positive", "negative"]}},
        RESPONSES: {"text": {"format": {"type": "json_schema", "name": "l", "schema": LABEL, "strict": True}}},
    }[endpoint]
    lines, expected = [], {}
    for index, (fields, param) in enumerate(bad):
        lines.append(_line(f"good-{index}", endpoint, **good_fields))
        lines.append(_line(f"bad-{index}", endpoint, **fields))
        expected[f"bad-{index}"] = (len(lines), param)
    lines.append(_line("good-last", endpoint))
    batch_id = _validated_batch(lines, endpoint, monkeypatch)

    assert run_batch(batch_id, engine=StandInEngine(served_tokenizer)) == BatchStatus.COMPLETED

    batch, output, errors = read_results(batch_id)
    assert set(errors) == set(expected)
    assert set(output) == {line["custom_id"] for line in lines} - set(expected)
    assert (batch.completed_requests, batch.failed_requests) == (len(lines) - len(bad), len(bad))
    for custom_id, (line_number, param) in expected.items():
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400
        error = response["body"]["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_value", param)
        assert error["message"].startswith(f"line {line_number}: {param}: "), error["message"]
    for custom_id, envelope in output.items():
        assert envelope["response"]["status_code"] == 200, custom_id


class _GrammarRefusingEngine(StandInEngine):
    """Refuses a constraint as the grammar engine does one it cannot compile (here: a regex holding ``(?<``)."""

    def add_request(self, request_id, prompt, params):
        constraint = params.structured_outputs
        if constraint is not None and constraint.regex is not None and "(?<" in constraint.regex:
            raise InvalidParameterError(f"the regex {constraint.regex!r} does not compile", param="structured_outputs")
        super().add_request(request_id, prompt, params)


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        (COMPLETIONS, {"structured_outputs": {"regex": "(?<x>a)"}}, "structured_outputs.regex"),
        (CHAT_COMPLETIONS, {"structured_outputs": {"regex": "(?<x>a)"}}, "structured_outputs.regex"),
        (COMPLETIONS, {"guided_regex": "(?<x>a)"}, "guided_regex"),
    ],
)
def test_a_constraint_the_engine_cannot_compile_names_its_body_field(
    service, served_tokenizer, endpoint, fields, param
):
    batch_id = make_batch(
        [_line("x", endpoint)["body"], _line("x", endpoint, **fields)["body"], _line("x", endpoint)["body"]],
        endpoint=endpoint,
    )

    assert run_batch(batch_id, engine=_GrammarRefusingEngine(served_tokenizer)) == BatchStatus.COMPLETED

    _, output, errors = read_results(batch_id)
    assert set(output) == {"line-1", "line-3"} and set(errors) == {"line-2"}
    error = errors["line-2"]["response"]["body"]["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert error["message"] == "line 2: the regex '(?<x>a)' does not compile"


def test_a_responses_batch_is_answered_with_response_objects(service, served_tokenizer, monkeypatch):
    from openai.types.responses import Response

    lines = [
        _line("short", RESPONSES, max_output_tokens=2, metadata={"row": "1"}),
        _line("too-long", RESPONSES, input="word " * 100),
        _line("instructed", RESPONSES, instructions="Answer in one word.", max_output_tokens=4, seed=1),
    ]
    batch_id = _validated_batch(lines, RESPONSES, monkeypatch)

    assert run_batch(batch_id, engine=StandInEngine(served_tokenizer, max_model_len=64)) == BatchStatus.COMPLETED

    batch, output, errors = read_results(batch_id)
    assert set(output) == {"short", "instructed"} and set(errors) == {"too-long"}
    error = errors["too-long"]["response"]["body"]["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    short = Response.model_validate(output["short"]["response"]["body"])
    assert short.status == "incomplete" and short.output_text == " ok ok"  # the stand-in always hits the limit
    assert short.metadata == {"row": "1"} and short.usage is not None and short.usage.output_tokens == 2
    instructed = Response.model_validate(output["instructed"]["response"]["body"])
    assert instructed.instructions == "Answer in one word." and instructed.usage is not None
    assert batch.output_tokens == 2 + 4
    assert batch.input_tokens == short.usage.input_tokens + instructed.usage.input_tokens

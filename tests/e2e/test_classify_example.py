"""The committed classification example job matches what examples/classify.py builds, and every line is
a strict structured-output request the body parse accepts (docs/api.md, "Structured outputs")."""

import json

import jsonschema
import pytest

from examples.classify import DEFAULT_OUTPUT, MAX_TOKENS, NUM_LINES, ReviewLabel, build_lines, response_format
from jobs.line_body import parse_body
from jobs.schemas import CHAT_COMPLETIONS
from jobs.structured_outputs import Constraint, strict_schema_problem


def test_committed_example_is_the_generated_job():
    committed = [json.loads(line) for line in DEFAULT_OUTPUT.read_text().splitlines()]
    assert committed == build_lines()


def test_every_line_is_a_distinct_greedy_strict_json_schema_request():
    lines = build_lines()
    assert len(lines) == NUM_LINES
    assert len({line["custom_id"] for line in lines}) == NUM_LINES
    assert len({line["body"]["messages"][-1]["content"] for line in lines}) == NUM_LINES
    schema = response_format()["json_schema"]["schema"]
    assert strict_schema_problem(schema) is None
    for line in lines:
        parsed = parse_body(CHAT_COMPLETIONS, line["body"])
        assert parsed.constraint == Constraint({"json": schema}, "response_format.json_schema.schema")
        assert parsed.max_tokens == MAX_TOKENS and parsed.temperature == 0


def test_an_answer_valid_under_the_schema_loads_into_the_model():
    answer = {"sentiment": "negative", "aspect": "battery", "stars": 1}
    jsonschema.validate(answer, response_format()["json_schema"]["schema"])
    assert ReviewLabel.model_validate(answer).stars == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**answer, "stars": 6}, response_format()["json_schema"]["schema"])

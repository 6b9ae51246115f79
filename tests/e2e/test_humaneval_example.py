"""The committed HumanEval example job matches what examples/humaneval.py builds."""

import json

from examples.humaneval import DEFAULT_OUTPUT, MAX_TOKENS, STOP, build_lines, load_problems
from jobs.schemas import CompletionBody


def test_committed_example_is_the_generated_job():
    problems = load_problems()
    assert len(problems) == 164
    committed = [json.loads(line) for line in DEFAULT_OUTPUT.read_text().splitlines()]
    assert committed == build_lines(problems)


def test_every_line_is_a_greedy_completion_request_the_api_accepts():
    problems = load_problems()
    lines = build_lines(problems)
    assert len({line["custom_id"] for line in lines}) == 164
    for problem, line in zip(problems, lines, strict=True):
        assert line["custom_id"] == problem["task_id"]
        assert line["url"] == "/v1/completions" and line["method"] == "POST"
        body = CompletionBody.model_validate(line["body"])
        assert body.prompt == problem["prompt"] and "def " in body.prompt
        assert body.max_tokens == MAX_TOKENS and body.temperature == 0 and body.stop == STOP

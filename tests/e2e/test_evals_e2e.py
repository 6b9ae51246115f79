"""An eval run end to end through the real ``openai`` SDK: API and worker (the real engine on the built-in
model) as child processes, as in tests/e2e/test_service_e2e.py (whose served stack this module reuses).

``client.evals.create`` with a ``string_check``, ``client.evals.runs.create`` with a ``completions``
data source of inline items, polling ``client.evals.runs.retrieve`` until the run ends, then
``client.evals.runs.output_items.list``: the run's counts are what ``string_check`` gives on the
outputs the items report.
"""

from __future__ import annotations

import time

import pytest

from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import TERMINAL
from tests.e2e.test_service_e2e import redis_url, service  # noqa: F401  (fixtures)
from tests.helpers.service import postgres_url  # noqa: F401  (fixture: a fresh, migrated database)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

ITEMS = [
    {"question": "What is the capital of France?", "expected": "Paris"},
    {"question": "Say hello.", "expected": ""},  # every answer contains the empty string: a pass
    {"question": "Name a colour.", "expected": "zq-never-said-qz"},  # no answer contains it: a fail
]


def test_an_eval_run_through_the_sdk_is_graded_by_its_string_check(service) -> None:
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
            "source": {"type": "file_content", "content": [{"item": item} for item in ITEMS]},
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
    expected = [item["expected"].lower() in output.lower() for item, output in zip(ITEMS, outputs, strict=True)]
    assert [item.status for item in items] == ["pass" if ok else "fail" for ok in expected]
    assert [item.results[0].passed for item in items] == expected
    counts = run.result_counts
    assert (counts.total, counts.passed, counts.failed, counts.errored) == (3, sum(expected), 3 - sum(expected), 0)
    assert expected[1] and not expected[2]
    assert run.per_testing_criteria_results[0].passed == sum(expected)
    usage = run.per_model_usage[0]
    assert usage.model_name == BUILTIN_MODEL and usage.invocation_count == 3 and 0 < usage.completion_tokens <= 24

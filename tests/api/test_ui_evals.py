"""``/ui/evals`` pages (api/routes/ui_evals.py): a scheduled eval fired twice shows a two-point trend and
its run page the counts, criteria and failing items beside their expected answers."""

from __future__ import annotations

import re
from typing import Any

from jobs.config import Settings
from jobs.queue import GRADE_EVAL_SHARD
from jobs.schedules import run_due_schedules
from tests.helpers.service import queued_tasks
from worker.eval_grading import grade_shard

ITEMS = [
    {"item": {"question": "2+2?", "answer": "4"}, "sample": {"output_text": "4"}},
    {"item": {"question": "Capital of France?", "answer": "Paris"}, "sample": {"output_text": "Lyon"}},
]
CRITERION = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def scheduled_eval_fired_twice(client: Any, settings: Settings) -> tuple[str, list[str]]:
    """An eval whose schedule fired on two days (runs graded here, as a worker would); its id and runs."""
    item_schema = {"type": "object", "properties": {"question": {}, "answer": {}}, "required": ["answer"]}
    body = {
        "name": "arithmetic",
        "data_source_config": {"type": "custom", "item_schema": item_schema},
        "testing_criteria": [CRITERION],
    }
    eval_id = client.post("/v1/evals", json=body).json()["id"]
    run = {"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": ITEMS}}}
    schedule = client.post("/v1/schedules", json={"cron": "0 3 * * *", "eval_id": eval_id, "run": run}).json()
    run_ids = []
    for day in range(2):
        (fired,) = run_due_schedules(now=schedule["next_run_at"] + day * 86400, settings=settings)
        run_ids.append(fired.run_id)
    for name, (run_id, shard_id) in queued_tasks(settings.broker_url):
        if name == GRADE_EVAL_SHARD:
            grade_shard(run_id, shard_id, database_url=settings.database_url)
    return eval_id, run_ids


def test_evals_page_plots_each_run_and_the_run_page_shows_failing_items(
    client: Any, service_settings: Settings
) -> None:
    eval_id, run_ids = scheduled_eval_fired_twice(client, service_settings)

    page = client.get("/ui/evals")
    assert page.status_code == 200, page.text
    assert page.text.count('class="point"') == 2
    assert 'data-criterion="exact"' in page.text
    for run_id in run_ids:
        assert f"/ui/evals/{eval_id}/runs/{run_id}" in page.text

    run_page = client.get(f"/ui/evals/{eval_id}/runs/{run_ids[1]}")
    assert run_page.status_code == 200, run_page.text
    assert "total 2, passed 1, failed 1, errored 0" in run_page.text
    assert re.search(r"<td>exact</td><td class=\"num\">1</td><td class=\"num\">1</td>", run_page.text)
    failing = run_page.text.split('id="failing"')[1]
    assert "Paris" in failing and "Lyon" in failing and "2+2?" not in failing

    assert client.get(f"/ui/evals/{eval_id}/runs/evalrun_nope").status_code == 404


def test_metrics_give_each_criterion_s_latest_pass_rate(client: Any, service_settings: Settings) -> None:
    eval_id, _ = scheduled_eval_fired_twice(client, service_settings)
    text = client.get("/metrics").text
    (line,) = [line for line in text.splitlines() if line.startswith("batchinfer_eval_latest_pass_rate{")]
    assert f'eval_id="{eval_id}"' in line and 'criterion="exact"' in line and 'model="' in line
    assert line.endswith(" 0.5")


def test_the_run_page_shows_an_item_refused_before_grading_with_its_error(client: Any) -> None:
    item_schema = {"type": "object", "properties": {"question": {}, "answer": {}}, "required": ["answer"]}
    body = {"data_source_config": {"type": "custom", "item_schema": item_schema}, "testing_criteria": [CRITERION]}
    eval_id = client.post("/v1/evals", json=body).json()["id"]
    content = [{"item": {"question": "no answer"}, "sample": {"output_text": "?"}}]
    run = {"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": content}}}
    run_id = client.post(f"/v1/evals/{eval_id}/runs", json=run).json()["id"]

    page = client.get(f"/ui/evals/{eval_id}/runs/{run_id}").text
    failing = page.split('id="failing"')[1]
    assert "error (invalid_item)" in failing and "answer" in failing and "no answer" in failing

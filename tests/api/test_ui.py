"""``/ui`` rendered on the server: batches with progress, a batch's plot, errors and file links, schedules,
workers, and the refresh marker while a batch runs. The browser test is tests/e2e/test_ui_browser.py."""

from __future__ import annotations

import re
from typing import Any

from jobs import repository, workers
from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, Settings
from jobs.db import session_scope
from jobs.shards import claim_next_shard
from jobs.status import now_s
from tests.helpers.service import CHAT, chat_line, jsonl


def _start_batch(client: Any, num_lines: int) -> str:
    data = jsonl([chat_line(f"q-{i}") for i in range(num_lines)])
    created = client.post("/v1/jobs", files={"file": ("job.jsonl", data)}, data={"endpoint": CHAT}).json()
    return created["id"]


def _record(settings: Settings, batch_id: str, *, ok: int, failed: int, start: int) -> None:
    with session_scope(settings.database_url) as session:
        claim_next_shard(session, owner="test:1", now=start, lease_s=60)
        pending = repository.pending_requests(session, batch_id=batch_id)
        for i, line in enumerate(pending[:ok]):
            body = {"usage": {"completion_tokens": 10}}
            repository.record_result(
                session,
                request_id=line.id,
                response={"status_code": 200, "request_id": "req_x", "body": body},
                error=None,
                completion_tokens=10,
                now=start + 1 + i,
            )
        for line in pending[ok : ok + failed]:
            body = {"error": {"message": "prompt is too long: 9000 tokens", "type": "invalid_request_error"}}
            repository.record_result(
                session,
                request_id=line.id,
                response={"status_code": 400, "request_id": "req_y", "body": body},
                error=None,
                now=start + ok + 1,
            )


def test_index_lists_batches_with_progress_schedules_and_workers(client: Any, service_settings: Settings) -> None:
    batch_id = _start_batch(client, 4)
    _record(service_settings, batch_id, ok=2, failed=1, start=now_s() - 10)
    with session_scope(service_settings.database_url) as session:
        workers.record_heartbeat(
            session,
            worker_id="gpu-7:99",
            host="gpu-7",
            pid=99,
            model="SmolLM2-135M-Instruct",
            device="cuda",
            current_batch_id=batch_id,
            num_running_requests=1,
            tokens_per_s=42.0,
            metrics_port=None,
            started_at=now_s(),
            now=now_s(),
            kv_cache=workers.KVCacheSize(kv_cache_dtype="int8", num_blocks=10965, num_bytes=10965 * 97920),
            engine_format=workers.EngineFormat(dtype="bfloat16", quantization="q4"),
        )
    file_id = client.get(f"/v1/batches/{batch_id}").json()["input_file_id"]
    client.post("/v1/schedules", json={"cron": "0 3 * * *", "endpoint": CHAT, "input_file_id": file_id})

    response = client.get("/ui")

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    row = re.search(rf'<tr data-batch-id="{batch_id}" data-status="in_progress">(.*?)</tr>', html, re.S)
    assert row, html
    assert 'aria-valuenow="3"' in row.group(1) and "2/1/4" in row.group(1)
    assert 'style="width: 50.00%"' in row.group(1) and 'style="width: 25.00%"' in row.group(1)
    assert '<td class="num">20</td>' in row.group(1)  # output tokens
    assert "0 3 * * *" in html and "gpu-7" in html and "42.0" in html
    assert '<td class="kv-cache">int8, 10965 blocks, 1024.0 MiB</td>' in html
    assert '<td class="engine-format">q4, bfloat16</td>' in html
    assert "data-refresh=" in html  # a batch is running


def test_batch_page_plots_lines_shows_errors_and_links_files(client: Any, service_settings: Settings) -> None:
    batch_id = _start_batch(client, 4)
    _record(service_settings, batch_id, ok=3, failed=1, start=now_s() - 10)
    running = client.get(f"/ui/batches/{batch_id}").text
    assert "data-refresh=" in running and 'id="output-file"' not in running
    with session_scope(service_settings.database_url) as session:
        repository.finalize_batch(session, batch_id=batch_id)

    html = client.get(f"/ui/batches/{batch_id}").text

    assert "data-refresh=" not in html and ">completed<" in html
    assert "total 4, completed 3, failed 1" in html
    lines_points = re.search(r'class="lines" points="([^"]+)"', html).group(1).split()
    assert len(lines_points) == 1 + 4  # the origin, then one point per second that saw a line finish
    assert lines_points[-1].split(",")[1] == "0.0"  # the last point reaches the top: every line
    assert "prompt is too long: 9000 tokens" in html
    output_link = re.search(r'id="output-file" href="([^"]+)"', html).group(1)
    assert re.search(r'id="error-file" href="/ui/files/file-', html)
    file_page = client.get(output_link).text
    assert file_page.count("&#34;custom_id&#34;") == 3 and 'href="/v1/files/' in file_page  # JSON, escaped


def test_unknown_batch_is_a_404(client: Any) -> None:
    assert client.get("/ui/batches/batch_nope").status_code == 404
    assert client.get("/ui/static/ui.js").status_code == 200


def _worker_row(settings: Settings, pid: int, *, ready_s: float | None, model: str = BUILTIN_MODEL) -> None:
    with session_scope(settings.database_url) as session:
        workers.record_heartbeat(
            session,
            worker_id=f"box:{pid}",
            host="box",
            pid=pid,
            model=model,
            device="cpu",
            current_batch_id=None,
            num_running_requests=0,
            tokens_per_s=0.0,
            metrics_port=None,
            started_at=now_s(),
            now=now_s(),
            ready_s=ready_s,
        )


def test_a_waiting_batch_says_when_no_worker_is_ready(client: Any, service_settings: Settings) -> None:
    batch_id = _start_batch(client, 2)
    note = 'id="waiting-note"'

    assert f"waiting: no worker serves model {BUILTIN_MODEL}" in client.get(f"/ui/batches/{batch_id}").text
    _worker_row(service_settings, 6, ready_s=1.0, model=BUILTIN_EMBEDDING_MODEL)  # another model's: no help
    page, index = client.get(f"/ui/batches/{batch_id}").text, client.get("/ui").text
    assert f"waiting: no worker serves model {BUILTIN_MODEL}" in page and note in index
    _worker_row(service_settings, 7, ready_s=None)
    page, index = client.get(f"/ui/batches/{batch_id}").text, client.get("/ui").text
    assert "waiting: no worker is ready (1 starting)" in page and note in index and ">starting<" in index

    _worker_row(service_settings, 7, ready_s=6.25)
    page, index = client.get(f"/ui/batches/{batch_id}").text, client.get("/ui").text
    assert note not in page and note not in index and "ready (in 6.2 s)" in index
    assert {w["id"]: w["ready_s"] for w in client.get("/v1/workers").json()["data"]}["box:7"] == 6.25

    _worker_row(service_settings, 7, ready_s=None)  # (a restart) none ready again, but the batch is over:
    assert client.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelled"
    assert note not in client.get(f"/ui/batches/{batch_id}").text and note not in client.get("/ui").text

"""An id or status the API has just returned is there on the very next request (PostgreSQL, real HTTP).

The app runs under uvicorn (`tests.helpers.service.serve_http`), not FastAPI's TestClient, which
finishes the whole request cycle before handing the response back and so hides a commit that runs
after the response was sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session

from jobs.config import Settings
from tests.helpers.service import (  # noqa: F401
    CHAT,
    chat_line,
    configure_service,
    jsonl,
    postgres_url,
    serve_http,
    sqlite_settings,
)

NUM_ROUNDS = 200


@pytest.fixture
def base_url(postgres_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    settings: Settings = configure_service(monkeypatch, tmp_path / "data", database_url=postgres_url)
    with serve_http(settings) as url:
        yield url


@pytest.mark.postgres
def test_every_write_is_visible_to_the_next_request(base_url: str) -> None:
    data = jsonl([chat_line("a"), chat_line("b")])
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for round_idx in range(NUM_ROUNDS):
            uploaded = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
            assert uploaded.status_code == 200, uploaded.text
            file_id = uploaded.json()["id"]
            fetched = client.get(f"/v1/files/{file_id}")
            assert fetched.status_code == 200, f"round {round_idx}: {fetched.text}"

            created = client.post(
                "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            )
            assert created.status_code == 200, f"round {round_idx}: {created.text}"
            batch_id = created.json()["id"]
            fetched = client.get(f"/v1/batches/{batch_id}")
            assert fetched.status_code == 200, f"round {round_idx}: {fetched.text}"

            cancelled = client.post(f"/v1/batches/{batch_id}/cancel")
            assert cancelled.status_code == 200, f"round {round_idx}: {cancelled.text}"
            assert cancelled.json()["status"] in ("cancelling", "cancelled")
            status = client.get(f"/v1/batches/{batch_id}").json()["status"]
            assert status in ("cancelling", "cancelled"), (
                f"round {round_idx}: cancel said cancelling, GET says {status}"
            )

            schedule = client.post(
                "/v1/schedules", json={"cron": "0 3 * * *", "input_file_id": file_id, "endpoint": CHAT}
            )
            assert schedule.status_code == 200, f"round {round_idx}: {schedule.text}"
            fetched = client.get(f"/v1/schedules/{schedule.json()['id']}")
            assert fetched.status_code == 200, f"round {round_idx}: {fetched.text}"


def test_a_failed_commit_is_an_error_response(sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(_session: Session) -> None:
        raise RuntimeError("the database went away")

    with serve_http(sqlite_settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        monkeypatch.setattr(Session, "commit", fail)
        response = client.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl([chat_line("a")]))}, data={"purpose": "batch"}
        )
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"

"""``/v1/files`` over HTTP: upload, list, retrieve, content, delete, and OpenAI-style errors."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.config import Settings
from tests.helpers.service import api_client, chat_line, jsonl

FILE_KEYS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status", "status_details", "expires_at"}


def _upload(client: Any, data: bytes, name: str = "requests.jsonl", purpose: str = "batch") -> Any:
    return client.post("/v1/files", files={"file": (name, data, "application/jsonl")}, data={"purpose": purpose})


def test_upload_retrieve_content_list_delete(client: Any) -> None:
    data = jsonl([chat_line("a"), chat_line("b")])
    created = _upload(client, data)
    assert created.status_code == 200, created.text
    body = created.json()
    assert set(body) == FILE_KEYS
    assert body["id"].startswith("file-") and body["object"] == "file"
    assert (body["bytes"], body["filename"], body["purpose"]) == (len(data), "requests.jsonl", "batch")

    assert client.get(f"/v1/files/{body['id']}").json() == body
    content = client.get(f"/v1/files/{body['id']}/content")
    assert content.status_code == 200 and content.content == data

    listed = client.get("/v1/files").json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [body["id"]]
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (body["id"], body["id"], False)

    deleted = client.delete(f"/v1/files/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "file", "deleted": True}
    missing = client.get(f"/v1/files/{body['id']}")
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": f"no file with id {body['id']!r}",
            "type": "invalid_request_error",
            "param": None,
            "code": "file_not_found",
        }
    }
    assert client.get(f"/v1/files/{body['id']}/content").status_code == 404
    assert client.delete(f"/v1/files/{body['id']}").status_code == 404


def test_files_page_with_after_and_limit(client: Any) -> None:
    ids = [_upload(client, jsonl([chat_line(str(i))]), name=f"{i}.jsonl").json()["id"] for i in range(5)]
    everything = client.get("/v1/files").json()["data"]
    assert sorted(f["id"] for f in everything) == sorted(ids)
    seen, after = [], None
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = client.get("/v1/files", params=params).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == [f["id"] for f in everything]
    ascending = client.get("/v1/files", params={"order": "asc"}).json()["data"]
    assert [f["id"] for f in ascending] == seen[::-1]


def test_upload_rejects_other_purposes_and_bad_requests(client: Any) -> None:
    wrong = _upload(client, b"{}\n", purpose="fine-tune")
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "purpose"
    no_file = client.post("/v1/files", data={"purpose": "batch"})
    assert no_file.status_code == 400
    assert no_file.json()["error"]["type"] == "invalid_request_error"
    assert no_file.json()["error"]["param"] == "file"
    bad_limit = client.get("/v1/files", params={"limit": 0})
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
    bad_cursor = client.get("/v1/files", params={"after": "file-nope"})
    assert bad_cursor.status_code == 400 and bad_cursor.json()["error"]["param"] == "after"


@pytest.mark.parametrize("size", [11, 200_000])  # counted while stored; refused by the request's Content-Length
def test_upload_over_the_byte_limit_is_a_413_naming_the_limit_and_not_kept(
    service_settings: Settings, size: int
) -> None:
    settings = service_settings.model_copy(update={"max_file_bytes": 10})
    with api_client(settings) as client:
        response = _upload(client, b"x" * size)
        assert response.status_code == 413
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("file_too_large", "file")
        assert "limit of 10 bytes" in error["message"]
        assert client.get("/v1/files").json()["data"] == []
        assert not settings.files_dir.exists() or list(settings.files_dir.iterdir()) == []
        assert _upload(client, b"x" * 10).status_code == 200


def test_upload_over_the_line_limit_is_a_413_naming_the_limit_and_not_kept(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_file_lines": 2})
    with api_client(settings) as client:
        response = _upload(client, jsonl([chat_line("a"), "", chat_line("b"), chat_line("c")]))
        assert response.status_code == 413
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("too_many_lines", "file")
        assert "limit of 2 requests" in error["message"]
        assert client.get("/v1/files").json()["data"] == []
        assert list(settings.files_dir.iterdir()) == []
        assert _upload(client, jsonl([chat_line("a"), "", chat_line("b")])).status_code == 200


def test_unknown_route_is_an_openai_style_404(client: Any) -> None:
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}

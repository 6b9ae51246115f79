"""Upload limits and dependency outages over HTTP (docs/api.md, "Limits" and "HTTP errors")."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from jobs.config import Settings
from tests.e2e.processes import ROOT, child_env, cli, free_port, running, wait_for_health
from tests.helpers.service import api_client, chat_line, jsonl

MB = 1_000_000


def _multipart(file_chunks: Iterator[bytes], boundary: str = "batchinfer-test-boundary") -> Iterator[bytes]:
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    yield from file_chunks
    yield f"\r\n--{boundary}--\r\n".encode()


def _lines_of(num_bytes: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """``num_bytes`` of JSONL (one line repeated), generated chunk by chunk."""
    line = jsonl([chat_line("x", "y" * 900)])
    chunk = line * (chunk_bytes // len(line))
    sent = 0
    while sent < num_bytes:
        piece = chunk[: num_bytes - sent]
        sent += len(piece)
        yield piece


def test_a_chunked_upload_over_the_limit_is_a_413_without_content_length(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_file_bytes": 1000})
    with api_client(settings) as client:
        response = client.post(
            "/v1/files",
            content=_multipart(_lines_of(300_000, chunk_bytes=4096)),
            headers={"Content-Type": "multipart/form-data; boundary=batchinfer-test-boundary"},
        )
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "file_too_large"
        assert "limit of 1000 bytes" in response.json()["error"]["message"]
        assert client.get("/v1/files").json()["data"] == []


@pytest.mark.parametrize("file_storage", ["local", "database"])
def test_database_unreachable_is_a_503_naming_it_and_leaves_no_file(
    service_settings: Settings, file_storage: str
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    unreachable = f"postgresql+psycopg://root@127.0.0.1:{closed_port}/batchinfer"
    settings = service_settings.model_copy(update={"database_url": unreachable, "file_storage": file_storage})
    with api_client(settings) as client:
        upload = client.post(
            "/v1/files", files={"file": ("a.jsonl", jsonl([chat_line("a")]))}, data={"purpose": "batch"}
        )
        for response in (
            upload,
            client.get("/v1/files"),
            client.get("/v1/batches/batch_abc"),
            client.post("/v1/jobs", files={"file": ("a.jsonl", b"{}\n")}, data={"endpoint": "/v1/completions"}),
        ):
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "database_unavailable")
            assert "database" in error["message"]
    files_dir = settings.files_dir
    assert not files_dir.exists() or list(files_dir.iterdir()) == []


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.mark.slow
def test_a_201_mb_upload_is_a_413_and_the_api_grows_by_under_50_mb(tmp_path: Path) -> None:
    """The real API process (uvicorn) gets a 201 MB upload with Content-Length; its peak resident set
    (``VmHWM``, reset just before) may grow by less than 50 MB."""
    port = free_port()
    env = child_env(data_dir=str(tmp_path / "data"))
    log = tmp_path / "api.log"
    subprocess.run(cli("db", "upgrade"), env=env, check=True, cwd=ROOT)
    with running(cli("api", "--host", "127.0.0.1", "--port", str(port)), env, log) as api:
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url, api, log)
        with httpx.Client(base_url=base_url, timeout=120) as client:
            assert client.get("/v1/files").status_code == 200  # warm: first request's imports and pools
            time.sleep(0.5)
            Path(f"/proc/{api.pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            before_kb = _rss_kb(api.pid, "VmRSS")
            body_bytes = sum(len(part) for part in _multipart(_lines_of(201 * MB)))
            response = client.post(
                "/v1/files",
                content=_multipart(_lines_of(201 * MB)),
                headers={
                    "Content-Type": "multipart/form-data; boundary=batchinfer-test-boundary",
                    "Content-Length": str(body_bytes),
                },
            )
            peak_kb = _rss_kb(api.pid, "VmHWM")
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "file_too_large" and "limit of 200000000 bytes" in error["message"]
        growth_mb = (peak_kb - before_kb) / 1000
        assert growth_mb < 50, f"the API's resident set grew by {growth_mb:.1f} MB"
    assert not (tmp_path / "data" / "files").exists() or list((tmp_path / "data" / "files").iterdir()) == []


def _json_of(num_bytes: int, chunk_bytes: int = 4096) -> Iterator[bytes]:
    """A JSON object of about ``num_bytes`` (one long metadata value), sent chunk by chunk."""
    yield b'{"metadata": {"x": "'
    for start in range(0, num_bytes, chunk_bytes):
        yield b"y" * min(chunk_bytes, num_bytes - start)
    yield b'"}}'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_json_body_over_the_request_limit_is_a_413_naming_the_setting(
    service_settings: Settings, chunked: bool
) -> None:
    settings = service_settings.model_copy(update={"max_request_body_bytes": 10_000})
    body = b"".join(_json_of(20_000))
    with api_client(settings) as client:
        response = client.post(
            "/v1/batches",
            content=_json_of(20_000) if chunked else body,
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large"
        assert "limit of 10000 bytes" in error["message"] and "BATCHINFER_MAX_REQUEST_BODY_BYTES" in error["message"]
        assert client.get("/v1/batches").json()["data"] == []


def test_a_json_body_within_the_request_limit_reaches_the_route(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_request_body_bytes": 10_000})
    with api_client(settings) as client:
        response = client.post(
            "/v1/batches", content=b"".join(_json_of(5_000)), headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, response.text  # the route's own validation: no input_file_id
        assert response.json()["error"]["code"] != "request_too_large"


def test_an_upload_over_the_request_limit_is_still_accepted(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_request_body_bytes": 1000})
    with api_client(settings) as client:
        response = client.post(
            "/v1/files",
            content=_multipart(_lines_of(20_000, chunk_bytes=4096)),
            headers={"Content-Type": "multipart/form-data; boundary=batchinfer-test-boundary"},
        )
        assert response.status_code == 200, response.text
        assert response.json()["bytes"] > 1000

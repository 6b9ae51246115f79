"""Per-key request rate and enqueued-token limits (docs/api.md, "Limits"), and their settings."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from pydantic import ValidationError

from api.quotas import enqueued_tokens
from api.rate_limits import RateLimited, RequestRate
from jobs.api_keys import create_key
from jobs.config import Settings
from jobs.db import session_scope
from jobs.repository import create_batch
from tests.helpers.service import CHAT, api_client, chat_line, jsonl, openai_client


def _secret(name: str) -> str:
    with session_scope() as session:
        return create_key(session, name=name).secret


def test_the_request_rate_is_a_bucket_of_a_minutes_requests_refilled_at_the_limits_pace() -> None:
    rate = RequestRate(max_per_minute=3)
    for _ in range(3):
        rate.take("key_a", now_s=100.0)
    with pytest.raises(RateLimited) as refused:
        rate.take("key_a", now_s=100.0)
    assert refused.value.retry_after_s == 20  # one request every 20 s
    assert "BATCHINFER_MAX_REQUESTS_PER_MINUTE" in refused.value.message
    rate.take("key_b", now_s=100.0)  # another key has its own bucket
    with pytest.raises(RateLimited) as sooner:
        rate.take("key_a", now_s=110.0)
    assert sooner.value.retry_after_s == 10
    rate.take("key_a", now_s=120.0)
    RequestRate(max_per_minute=0).take("key_a", now_s=0.0)  # 0: no limit


def test_a_key_over_its_request_rate_gets_429s_with_retry_after_and_other_keys_do_not(
    service_settings: Settings,
) -> None:
    alice, bob = _secret("alice"), _secret("bob")
    settings = service_settings.model_copy(update={"max_requests_per_minute": 3})
    with api_client(settings) as client:
        as_alice = {"Authorization": f"Bearer {alice}"}
        assert [client.get("/v1/files", headers=as_alice).status_code for _ in range(3)] == [200] * 3
        refused = client.get("/v1/batches", headers=as_alice)
        assert refused.status_code == 429, refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "limit 3" in error["message"] and "BATCHINFER_MAX_REQUESTS_PER_MINUTE" in error["message"]
        with pytest.raises(openai.RateLimitError) as sdk_refused:
            openai_client(client, api_key=alice).files.list()
        assert sdk_refused.value.code == "rate_limit_exceeded"
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {bob}"}).status_code == 200
        assert client.get("/health").status_code == 200  # open routes are not counted
        assert client.get("/v1/files", headers={"Authorization": "Bearer bi-wrong"}).status_code == 401


def test_without_keys_requests_are_counted_per_client_address(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_requests_per_minute": 2})
    with api_client(settings) as client:
        assert [client.get("/v1/models").status_code for _ in range(3)] == [200, 200, 429]
        assert "client testclient" in client.get("/v1/models").json()["error"]["message"]


def test_a_batch_over_the_keys_enqueued_tokens_is_a_429_token_limit_exceeded_until_a_batch_ends(
    service_settings: Settings,
) -> None:
    alice, bob = _secret("alice"), _secret("bob")
    data = jsonl([chat_line("a"), chat_line("b")])  # validated: 2 x (3 prompt + 256 completion) tokens
    settings = service_settings.model_copy(update={"max_enqueued_tokens": 600})
    with api_client(settings) as client:
        sdk = openai_client(client, api_key=alice)
        uploaded = sdk.files.create(file=("in.jsonl", data), purpose="batch")
        first = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        assert sdk.batches.retrieve(first.id).status == "in_progress"  # 518 tokens enqueued
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        assert refused.value.code == "token_limit_exceeded"
        assert refused.value.response.headers["retry-after"] == "60"
        assert refused.value.response.json()["error"]["type"] == "tokens"
        assert "about 518 are enqueued" in refused.value.message
        assert "BATCHINFER_MAX_ENQUEUED_TOKENS" in refused.value.message
        job = client.post(
            "/v1/jobs",
            files={"file": ("in.jsonl", data)},
            data={"endpoint": CHAT},
            headers={"Authorization": f"Bearer {alice}"},
        )
        assert job.status_code == 429 and job.json()["error"]["code"] == "token_limit_exceeded"
        assert len(sdk.files.list().data) == 1  # the refused job stored nothing
        bobs = openai_client(client, api_key=bob)
        bobs_file = bobs.files.create(file=("in.jsonl", data), purpose="batch")
        bobs.batches.create(input_file_id=bobs_file.id, endpoint=CHAT, completion_window="24h")  # his own queue

        assert sdk.batches.cancel(first.id).status == "cancelled"
        second = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        assert sdk.batches.retrieve(second.id).status == "in_progress"


def test_a_batch_still_validating_counts_its_input_files_bytes_over_4(service_settings: Settings) -> None:
    with api_client(service_settings) as client:
        uploaded = openai_client(client).files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    with session_scope() as session:
        assert enqueued_tokens(session, owner=None) == 0
        create_batch(session, input_file_id=uploaded.id, endpoint=CHAT)  # not validated: no shards yet
        assert enqueued_tokens(session, owner=None) == uploaded.bytes // 4
        assert enqueued_tokens(session, owner="key_other") == 0


def test_a_batch_alone_over_the_enqueued_token_limit_is_a_400(service_settings: Settings) -> None:
    settings = service_settings.model_copy(update={"max_enqueued_tokens": 10})
    with api_client(settings) as client:
        sdk = openai_client(client)
        uploaded = sdk.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        assert (refused.value.code, refused.value.param) == ("token_limit_exceeded", "input_file_id")
        assert "split the file" in refused.value.message


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"upload_read_timeout_s": "0"}, "upload_read_timeout_s"),
        ({"upload_timeout_s": "-1"}, "upload_timeout_s"),
        ({"upload_read_timeout_s": "60", "upload_timeout_s": "30"}, "must be at least upload_read_timeout_s"),
        ({"max_concurrent_uploads": "-1"}, "max_concurrent_uploads"),
        ({"max_concurrent_uploads": "4", "max_concurrent_uploads_per_key": "8"}, "must not exceed"),
        ({"max_requests_per_minute": "-5"}, "max_requests_per_minute"),
        ({"max_enqueued_tokens": "lots"}, "max_enqueued_tokens"),
    ],
)
def test_request_limit_settings_are_checked(
    env: dict[str, str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(f"BATCHINFER_{name.upper()}", value)
    with pytest.raises(ValidationError, match=message):
        Settings()


def test_request_limit_settings_default_to_bounded_uploads_and_no_rate_or_token_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHINFER_MAX_CONCURRENT_UPLOADS", "0")  # 0: no cap in all, any cap per key
    settings = Settings()
    assert (settings.upload_read_timeout_s, settings.upload_timeout_s) == (30.0, 1800.0)
    assert (settings.max_concurrent_uploads, settings.max_concurrent_uploads_per_key) == (0, 8)
    assert (settings.max_requests_per_minute, settings.max_enqueued_tokens) == (0, 0)

"""Repository functions on SQLite and PostgreSQL: validation outcome, results, cancel, expiry, finalize.

The central invariant (docs/api.md, "Output and error files"): at every terminal status each input line appears exactly once,
in exactly one of the output and error files.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.orm import Session

from jobs.config import BUILTIN_MODEL, Settings
from jobs.db import get_engine, session_scope
from jobs.errors import InvalidRequest, NotFound
from jobs.files import file_chunks, get_file, write_file
from jobs.models import Base, Batch
from jobs.repository import (
    BatchNotFinished,
    RequestAlreadyRecorded,
    apply_validation,
    batch_status,
    cancel_batch,
    completed_lines,
    create_batch,
    finalize_batch,
    get_batch,
    is_past_expiry,
    pending_requests,
    record_result,
)
from jobs.schemas import LineError
from jobs.shards import claim_next_shard
from jobs.status import BatchStatus, IllegalTransition
from jobs.validation import ValidatedLine
from tests.helpers.service import CHAT, chat_line, jsonl, postgres_url, service_settings  # noqa: F401

T0 = 1_800_000_000
NUM_LINES = 6


def _claim(session: Session, now: int = T0 + 1) -> bool:
    """A worker claims the batch's (single) shard."""
    return claim_next_shard(session, owner="test:1", now=now, lease_s=60) is not None


def _ok(request_id: str, tokens: int = 3) -> dict[str, Any]:
    return {"status_code": 200, "request_id": f"req-{request_id}", "body": {"object": "chat.completion", "n": tokens}}


def _new_batch(session: Session, settings: Settings, num_lines: int = NUM_LINES) -> Batch:
    lines = [chat_line(f"line-{idx}") for idx in range(num_lines)]
    file = write_file(session, chunks=[jsonl(lines)], filename="in.jsonl", purpose="batch")
    batch = create_batch(session, input_file_id=file.id, endpoint=CHAT, metadata={"k": "v"}, now=T0)
    validated = [
        ValidatedLine(line_number=idx + 1, custom_id=line["custom_id"], body=line["body"])
        for idx, line in enumerate(lines)
    ]
    return apply_validation(session, batch_id=batch.id, lines=validated, errors=[], model="m", now=T0 + 1)


def _read_jsonl(settings: Settings, session: Session, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    file = get_file(session, file_id=file_id)
    assert file is not None and file.purpose == "batch_output"
    data = b"".join(file_chunks(file))
    assert file.num_bytes == len(data)
    return [json.loads(line) for line in data.decode().splitlines()]


def _assert_each_line_exactly_once(settings: Settings, session: Session, batch: Batch) -> tuple[list[dict], list[dict]]:
    output = _read_jsonl(settings, session, batch.output_file_id)
    errors = _read_jsonl(settings, session, batch.error_file_id)
    custom_ids = [line["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"line-{idx}" for idx in range(batch.total_requests))
    assert len(set(custom_ids)) == len(custom_ids)
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["id"].startswith("batch_req_")
    for line in errors:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert (line["response"] is None) != (line["error"] is None)
        assert line["response"] is None or line["response"]["status_code"] != 200
    assert batch.completed_requests == len(output)
    assert batch.failed_requests == len(errors)
    return output, errors


def test_migrations_match_models(service_settings: Settings) -> None:
    with get_engine(service_settings.database_url).connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []


def test_create_batch_rejects_bad_parameters(service_settings: Settings) -> None:
    with session_scope() as session:
        file = write_file(session, chunks=[b"{}\n"], filename="in.jsonl", purpose="batch")
        cases = [
            ({"input_file_id": "file-nope", "endpoint": CHAT}, "input_file_id"),
            ({"input_file_id": file.id, "endpoint": "/v1/moderations"}, "endpoint"),
            ({"input_file_id": file.id, "endpoint": CHAT, "completion_window": "48h"}, "completion_window"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {"k" * 65: "v"}}, "metadata"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {"k": "v" * 513}}, "metadata"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {"priority": "high"}}, "metadata"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {"k": "v\x00"}}, "metadata"),
            ({"input_file_id": file.id, "endpoint": CHAT, "metadata": {"k\ud800": "v"}}, "metadata"),
            ({"input_file_id": "file-\x00", "endpoint": CHAT}, "input_file_id"),
        ]
        for kwargs, param in cases:
            with pytest.raises(InvalidRequest) as info:
                create_batch(session, **kwargs)
            assert info.value.param == param
        with pytest.raises(InvalidRequest) as info:
            write_file(session, chunks=[b"{}\n"], filename="in\x00.jsonl", purpose="batch")
        assert info.value.param == "file" and "NUL" in info.value.message
        for bad_id in ("batch_\x00", "batch_\udc00", "batch_" + "0" * 100):
            with pytest.raises(NotFound):
                get_batch(session, batch_id=bad_id)
        batch = create_batch(
            session, input_file_id=file.id, endpoint=CHAT, metadata={str(i): "v" for i in range(16)}, now=T0
        )
        assert batch.status == "validating" and batch.expires_at == T0 + 24 * 3600


def test_failed_validation_stores_errors_and_no_lines(service_settings: Settings) -> None:
    with session_scope() as session:
        file = write_file(session, chunks=[b"x\n"], filename="in.jsonl", purpose="batch")
        batch = create_batch(session, input_file_id=file.id, endpoint=CHAT, now=T0)
        errors = [LineError(code="invalid_json", message="bad", param=None, line=1)]
        batch = apply_validation(session, batch_id=batch.id, lines=[], errors=errors, model="m", now=T0 + 2)
        assert batch.status == "failed" and batch.failed_at == T0 + 2
        assert batch.errors == [{"code": "invalid_json", "message": "bad", "param": None, "line": 1}]
        assert pending_requests(session, batch_id=batch.id) == []
        with pytest.raises(IllegalTransition):
            apply_validation(session, batch_id=batch.id, lines=[], errors=[], model="m")


def test_completed_batch_every_line_in_exactly_one_file(service_settings: Settings) -> None:
    with session_scope() as session:
        batch = _new_batch(session, service_settings)
        batch_id = batch.id
        assert batch.status == "in_progress" and batch.total_requests == NUM_LINES and batch.model == "m"
    with session_scope() as session:
        assert _claim(session)
        pending = pending_requests(session, batch_id=batch_id)
        assert [row.line_number for row in pending] == list(range(1, NUM_LINES + 1))
        for row in pending[:4]:
            record_result(
                session,
                request_id=row.id,
                response=_ok(row.id),
                error=None,
                prompt_tokens=10,
                completion_tokens=5,
                cached_tokens=4,
            )
        too_long = {
            "status_code": 400,
            "request_id": "r",
            "body": {"error": {"message": "too long", "code": "context_length_exceeded"}},
        }
        assert (
            record_result(session, request_id=pending[4].id, response=too_long, error=None, prompt_tokens=0).value
            == "failed"
        )
        record_result(
            session, request_id=pending[5].id, response=None, error={"code": "internal_error", "message": "boom"}
        )
        with pytest.raises(RequestAlreadyRecorded):
            record_result(session, request_id=pending[0].id, response=_ok("x"), error=None)
    with session_scope() as session, pytest.raises(NotFound):
        record_result(session, request_id="batch_req_nope", response=_ok("x"), error=None)
    with session_scope() as session:
        batch = finalize_batch(session, batch_id=batch_id, now=T0 + 50)
        assert batch.status == "completed"
        assert batch.finalizing_at == T0 + 50 and batch.completed_at == T0 + 50
        assert (batch.input_tokens, batch.output_tokens, batch.cached_tokens) == (40, 20, 16)
        output, errors = _assert_each_line_exactly_once(service_settings, session, batch)
        assert len(output) == 4 and len(errors) == 2
        assert {line["custom_id"] for line in errors} == {"line-4", "line-5"}
        assert finalize_batch(session, batch_id=batch_id).output_file_id == batch.output_file_id


def test_finalize_refuses_an_unfinished_unexpired_batch(service_settings: Settings) -> None:
    with session_scope() as session:
        batch = _new_batch(session, service_settings)
        with pytest.raises(BatchNotFinished, match=f"{NUM_LINES} pending"):
            finalize_batch(session, batch_id=batch.id, now=T0 + 60)


def test_cancel_after_claim_then_finalize_keeps_finished_lines(service_settings: Settings) -> None:
    with session_scope() as session:
        batch_id = _new_batch(session, service_settings).id
        assert _claim(session)
        for row in pending_requests(session, batch_id=batch_id)[:2]:
            record_result(
                session, request_id=row.id, response=_ok(row.id), error=None, prompt_tokens=1, completion_tokens=1
            )
    with session_scope() as session:
        batch = cancel_batch(session, batch_id=batch_id, now=T0 + 10)
        assert batch.status == "cancelling" and batch.cancelling_at == T0 + 10
        assert batch_status(session, batch_id=batch_id) == BatchStatus.CANCELLING
        assert not _claim(session)
    with session_scope() as session:
        batch = finalize_batch(session, batch_id=batch_id, now=T0 + 20)
        assert batch.status == "cancelled" and batch.cancelled_at == T0 + 20
        output, errors = _assert_each_line_exactly_once(service_settings, session, batch)
        assert len(output) == 2 and len(errors) == NUM_LINES - 2
        assert all(line["error"]["code"] == "batch_cancelled" and line["response"] is None for line in errors)
        assert cancel_batch(session, batch_id=batch_id).status == "cancelled"


def test_cancel_before_any_worker_claims_finalizes_at_once(service_settings: Settings) -> None:
    with session_scope() as session:
        batch_id = _new_batch(session, service_settings).id
    with session_scope() as session:
        batch = cancel_batch(session, batch_id=batch_id, now=T0 + 5)
        assert batch.status == "cancelled" and batch.cancelling_at == T0 + 5 and batch.cancelled_at == T0 + 5
        output, errors = _assert_each_line_exactly_once(service_settings, session, batch)
        assert output == [] and batch.output_file_id is None
        assert [line["error"]["code"] for line in errors] == ["batch_cancelled"] * NUM_LINES
    with session_scope() as session:
        assert not _claim(session)
        assert pending_requests(session, batch_id=batch_id) == []


def test_cancel_while_validating_ends_cancelled_when_validation_lands(service_settings: Settings) -> None:
    with session_scope() as session:
        file = write_file(session, chunks=[b"{}\n"], filename="in.jsonl", purpose="batch")
        batch_id = create_batch(session, input_file_id=file.id, endpoint=CHAT, now=T0).id
    with session_scope() as session:
        assert cancel_batch(session, batch_id=batch_id, now=T0 + 1).status == "cancelling"
    with session_scope() as session:
        line = chat_line("line-0")
        batch = apply_validation(
            session,
            batch_id=batch_id,
            lines=[ValidatedLine(1, "line-0", line["body"])],
            errors=[],
            model="m",
            now=T0 + 2,
        )
        assert batch.status == "cancelled" and batch.in_progress_at is None
        _, errors = _assert_each_line_exactly_once(service_settings, session, batch)
        assert [line["error"]["code"] for line in errors] == ["batch_cancelled"]


def test_cancel_terminal_batch_is_illegal(service_settings: Settings) -> None:
    with session_scope() as session:
        batch = _new_batch(session, service_settings, num_lines=1)
        row = pending_requests(session, batch_id=batch.id)[0]
        record_result(session, request_id=row.id, response=_ok(row.id), error=None)
        finalize_batch(session, batch_id=batch.id)
        with pytest.raises(IllegalTransition, match="'completed' to 'cancelling'"):
            cancel_batch(session, batch_id=batch.id)
        with pytest.raises(NotFound):
            cancel_batch(session, batch_id="batch_nope")


def test_expired_batch_keeps_finished_lines_and_reports_the_rest(service_settings: Settings) -> None:
    with session_scope() as session:
        batch = _new_batch(session, service_settings)
        batch_id, expires_at = batch.id, batch.expires_at
        assert not is_past_expiry(batch, expires_at - 1) and is_past_expiry(batch, expires_at)
        assert _claim(session)
        for row in pending_requests(session, batch_id=batch_id)[:3]:
            record_result(session, request_id=row.id, response=_ok(row.id), error=None)
    with session_scope() as session:
        batch = finalize_batch(session, batch_id=batch_id, now=expires_at + 1)
        assert batch.status == "expired" and batch.expired_at == expires_at + 1 and batch.finalizing_at is None
        output, errors = _assert_each_line_exactly_once(service_settings, session, batch)
        assert len(output) == 3
        assert [line["error"]["code"] for line in errors] == ["batch_expired"] * 3
        assert all("expired" in line["error"]["message"] for line in errors)


def test_get_batch_and_status_of_unknown_id_raise_not_found(service_settings: Settings) -> None:
    with session_scope() as session:
        with pytest.raises(NotFound):
            get_batch(session, batch_id="batch_nope")
        with pytest.raises(NotFound):
            batch_status(session, batch_id="batch_nope")


def test_completed_lines_are_the_models_own_answers(service_settings: Settings) -> None:
    """``batchinfer heads train --from-db``: completed lines of the model, newest first, with their answer."""
    with session_scope() as session:
        batch_id = _new_batch(session, service_settings, num_lines=3).id
    with session_scope() as session:
        assert _claim(session)
        rows = pending_requests(session, batch_id=batch_id)
        for n, row in enumerate(rows[:2]):
            body = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": f"a{n}"}}]}
            response = {"status_code": 200, "request_id": "r", "body": body}
            record_result(session, request_id=row.id, response=response, error=None, now=T0 + 10 + n)
        record_result(session, request_id=rows[2].id, response=None, error={"code": "internal_error", "message": "x"})
    with session_scope() as session:
        lines = completed_lines(session, model=BUILTIN_MODEL, limit=5)
        assert [text for _, text in lines] == ["a1", "a0"]
        assert lines[0][0]["messages"] == [{"role": "user", "content": "Say hi."}]
        assert completed_lines(session, model=BUILTIN_MODEL, limit=1) == lines[:1]
        assert completed_lines(session, model="another", limit=5) == []

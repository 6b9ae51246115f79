"""API keys and ownership (docs/api.md, "API keys"): each key sees only what it created, through the
real ``openai`` SDK and every route of the app; a deployment without keys stays open."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from jobs.api_keys import create_key, list_keys, revoke_key
from jobs.config import Settings
from jobs.db import session_scope
from jobs.files import file_chunks, get_file
from tests.helpers.service import CHAT, api_client, chat_line, jsonl, openai_client

OWNED_PARAMS = {"file_id", "batch_id", "schedule_id"}


def _new_key(name: str) -> tuple[str, str]:
    with session_scope() as session:
        created = create_key(session, name=name)
    return created.key.id, created.secret


@pytest.fixture
def two_keys(service_settings: Settings) -> Iterator[tuple[str, str]]:
    _, alice = _new_key("alice")
    _, bob = _new_key("bob")
    yield alice, bob


def _alices_objects(client: Any, alice: str) -> dict[str, str]:
    """Alice's input file, a cancelled batch (so an error file with line results), a schedule."""
    sdk = openai_client(client, api_key=alice)
    data = jsonl([chat_line("q1"), chat_line("q2")])
    uploaded = sdk.files.create(file=("alice.jsonl", data), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    cancelled = sdk.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.error_file_id is not None
    headers = {"Authorization": f"Bearer {alice}"}
    schedule = client.post(
        "/v1/schedules", json={"cron": "0 3 * * *", "endpoint": CHAT, "input_file_id": uploaded.id}, headers=headers
    )
    assert schedule.status_code == 200, schedule.text
    return {
        "file_id": uploaded.id,
        "error_file_id": cancelled.error_file_id,
        "batch_id": batch.id,
        "schedule_id": schedule.json()["id"],
    }


def test_each_key_sees_only_its_own_objects_through_the_sdk(service_settings: Settings, two_keys: Any) -> None:
    alice, bob = two_keys
    with api_client(service_settings) as client:
        ids = _alices_objects(client, alice)
        alice_sdk, bob_sdk = openai_client(client, api_key=alice), openai_client(client, api_key=bob)

        assert alice_sdk.batches.retrieve(ids["batch_id"]).id == ids["batch_id"]
        assert b"batch_cancelled" in alice_sdk.files.content(ids["error_file_id"]).content
        assert {f.id for f in alice_sdk.files.list()} == {ids["error_file_id"], ids["file_id"]}

        for call in (
            lambda: bob_sdk.batches.retrieve(ids["batch_id"]),
            lambda: bob_sdk.batches.cancel(ids["batch_id"]),
            lambda: bob_sdk.files.retrieve(ids["file_id"]),
            lambda: bob_sdk.files.content(ids["file_id"]),
            lambda: bob_sdk.files.content(ids["error_file_id"]),
            lambda: bob_sdk.files.delete(ids["error_file_id"]),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert list(bob_sdk.files.list()) == [] and list(bob_sdk.batches.list()) == []
        with pytest.raises(openai.BadRequestError) as refused:
            bob_sdk.batches.create(input_file_id=ids["file_id"], endpoint=CHAT, completion_window="24h")
        assert (refused.value.code, refused.value.param) == ("file_not_found", "input_file_id")
        with pytest.raises(openai.BadRequestError) as refused:
            bob_sdk.batches.list(after=ids["batch_id"])
        assert refused.value.param == "after"

        # A key of Bob's own works side by side; the objects Alice owns are untouched.
        bobs = bob_sdk.files.create(file=("bob.jsonl", jsonl([chat_line("b")])), purpose="batch")
        assert [f.id for f in bob_sdk.files.list()] == [bobs.id]
        assert alice_sdk.files.retrieve(ids["error_file_id"]).id == ids["error_file_id"]


def _routes(routes: list[Any]) -> Iterator[Any]:
    """Every route, those of included routers too."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from _routes(included.routes) if included is not None else [route]


def test_another_keys_ids_are_404_on_every_route(service_settings: Settings, two_keys: Any) -> None:
    """Walk the app's routes: each one with a file, batch or schedule id in its path answers Bob 404."""
    alice, bob = two_keys
    with api_client(service_settings) as client:
        ids = _alices_objects(client, alice)
        checked = []
        for route in _routes(client.app.routes):
            params = set(re.findall(r"{(\w+)}", getattr(route, "path", "")))
            if not params or not params <= OWNED_PARAMS:
                continue
            for method in sorted(route.methods - {"HEAD"}):
                values = [dict(ids)] + ([{**ids, "file_id": ids["error_file_id"]}] if "file_id" in params else [])
                for value in values:
                    path = route.path.format(**value)
                    as_bob = client.request(method, path, headers={"Authorization": f"Bearer {bob}"})
                    assert as_bob.status_code == 404, (method, path, as_bob.text)
                    checked.append((method, route.path))
        # /v1/files/{id} GET+DELETE, content, /v1/batches/{id}, cancel, /v1/schedules/{id} GET+DELETE, 2 /ui pages
        assert len(set(checked)) >= 9, checked
        # Nothing Bob tried changed Alice's objects.
        alice_headers = {"Authorization": f"Bearer {alice}"}
        for path in (f"/v1/files/{ids['error_file_id']}", f"/v1/schedules/{ids['schedule_id']}"):
            assert client.get(path, headers=alice_headers).status_code == 200
        assert client.get(f"/ui/batches/{ids['batch_id']}", headers=alice_headers).status_code == 200
        bobs_index = client.get("/ui", headers={"Authorization": f"Bearer {bob}"})
        assert bobs_index.status_code == 200 and ids["batch_id"] not in bobs_index.text
        with session_scope() as session:
            error_file = get_file(session, file_id=ids["error_file_id"])
            assert error_file is not None and b"q1" in b"".join(file_chunks(error_file))


def test_without_a_live_key_a_deployment_with_keys_answers_401(service_settings: Settings, two_keys: Any) -> None:
    alice, _ = two_keys
    with api_client(service_settings) as client:
        for headers in ({}, {"Authorization": "Bearer bi-wrong"}, {"Authorization": "Basic !!"}):
            response = client.get("/v1/batches", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/ui").headers["WWW-Authenticate"].startswith("Basic")
        basic = base64.b64encode(f"me:{alice}".encode()).decode()
        assert client.get("/ui", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai_client(client).models.list()

        with session_scope() as session:
            (alice_key,) = [key for key in list_keys(session) if key.name == "alice"]
            revoke_key(session, key_id=alice_key.id)
        assert client.get("/v1/batches", headers={"Authorization": f"Bearer {alice}"}).status_code == 401


def test_keys_are_stored_hashed(service_settings: Settings) -> None:
    key_id, secret = _new_key("ops")
    with session_scope() as session:
        (key,) = list_keys(session)
    assert key.id == key_id and secret.startswith(key.key_prefix) and secret not in (key.key_hash, key.key_prefix)
    assert len(key.key_hash) == 64


def test_a_deployment_without_keys_is_open_and_says_so(service_settings: Settings, caplog: Any) -> None:
    with caplog.at_level("WARNING", logger="api.main"), api_client(service_settings) as client:
        sdk = openai_client(client, api_key="anything")
        uploaded = sdk.files.create(file=("x.jsonl", jsonl([chat_line("a")])), purpose="batch")
        assert client.get(f"/v1/files/{uploaded.id}").status_code == 200  # no header at all
        for _ in range(50):
            if any("API is open" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.1)
    assert any("API is open" in r.getMessage() for r in caplog.records)


def test_workers_show_a_running_batch_id_only_to_its_owner(service_settings: Settings, two_keys: Any) -> None:
    from jobs.status import now_s
    from jobs.workers import record_heartbeat

    alice, bob = two_keys
    with api_client(service_settings) as client:
        batch_id = _alices_objects(client, alice)["batch_id"]
        with session_scope() as session:
            for worker_id, current in (("gpu-a:1", batch_id), ("gpu-b:2", None)):
                host, pid = worker_id.split(":")
                record_heartbeat(
                    session,
                    worker_id=worker_id,
                    host=host,
                    pid=int(pid),
                    model="m",
                    device="cpu",
                    current_batch_id=current,
                    num_running_requests=3 if current else 0,
                    tokens_per_s=1.0,
                    metrics_port=None,
                    started_at=now_s(),
                    now=now_s(),
                )
        seen = {}
        for name, key in (("alice", alice), ("bob", bob)):
            headers = {"Authorization": f"Bearer {key}"}
            listed = client.get("/v1/workers", headers=headers).json()["data"]
            seen[name] = {w["id"]: w["current_batch_id"] for w in listed}
            page = client.get("/ui", headers=headers)
            assert page.status_code == 200 and (batch_id in page.text) == (name == "alice"), name
        assert seen["alice"] == {"gpu-a:1": batch_id, "gpu-b:2": None}
        assert seen["bob"] == {"gpu-a:1": None, "gpu-b:2": None}  # Bob sees the worker, not Alice's batch
        assert "another key's batch" in client.get("/ui", headers={"Authorization": f"Bearer {bob}"}).text

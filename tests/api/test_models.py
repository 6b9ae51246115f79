"""``/v1/models``: every configured model with its kind, aliases and the live workers serving it."""

from __future__ import annotations

from typing import Any

from jobs import workers
from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, ModelEntry, Settings
from jobs.db import session_scope
from jobs.status import now_s


def _beat(
    settings: Settings,
    pid: int,
    model: str,
    *,
    ready_s: float | None = 3.0,
    age_s: int = 0,
    engine: tuple[str, str, str] | None = None,
) -> None:
    """A heartbeat of worker ``box:pid``; ``engine``: the (dtype, quantization, kv_cache_dtype) it reports."""
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
            started_at=now_s() - age_s,
            now=now_s() - age_s,
            ready_s=ready_s,
            kv_cache=workers.KVCacheSize(engine[2], num_blocks=64, num_bytes=1 << 20) if engine else None,
            engine_format=workers.EngineFormat(dtype=engine[0], quantization=engine[1]) if engine else None,
        )


def _counts(client: Any) -> dict[str, tuple[str, int, int]]:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    return {m["id"]: (m["kind"], m["num_workers"], m["num_ready_workers"]) for m in body["data"]}


def test_live_worker_counts_follow_the_heartbeats(client: Any, service_settings: Settings) -> None:
    service_settings.models = [*service_settings.models, ModelEntry(name="tiny", source="/m/tiny", aliases=["t"])]
    assert _counts(client) == {
        BUILTIN_MODEL: ("generate", 0, 0),
        BUILTIN_EMBEDDING_MODEL: ("embed", 0, 0),
        "tiny": ("generate", 0, 0),
    }
    _beat(service_settings, 1, BUILTIN_MODEL)
    _beat(service_settings, 2, BUILTIN_MODEL, ready_s=None)  # still loading its model
    _beat(service_settings, 3, "tiny")
    _beat(service_settings, 4, BUILTIN_EMBEDDING_MODEL, age_s=int(service_settings.worker_live_s) + 5)  # stopped
    assert _counts(client) == {
        BUILTIN_MODEL: ("generate", 2, 1),
        BUILTIN_EMBEDDING_MODEL: ("embed", 0, 0),
        "tiny": ("generate", 1, 1),
    }
    _beat(service_settings, 4, BUILTIN_EMBEDDING_MODEL)  # beats again
    with session_scope(service_settings.database_url) as session:
        workers.remove_worker(session, worker_id="box:3")  # stopped cleanly
    assert _counts(client)["tiny"] == ("generate", 0, 0)
    assert _counts(client)[BUILTIN_EMBEDDING_MODEL] == ("embed", 1, 1)

    by_alias = client.get("/v1/models/t").json()
    assert (by_alias["id"], by_alias["object"], by_alias["aliases"], by_alias["num_workers"]) == (
        "tiny",
        "model",
        ["t"],
        0,
    )
    missing = client.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_each_generate_model_shows_its_quantization_and_kv_cache_dtype(client: Any, service_settings: Settings) -> None:
    service_settings.models = [
        *service_settings.models,
        ModelEntry(name="tiny-q4", source="/m/tiny", quantization="q4", kv_cache_dtype="fp8"),
    ]
    shown = {m["id"]: (m["quantization"], m["kv_cache_dtype"]) for m in client.get("/v1/models").json()["data"]}
    assert shown == {
        BUILTIN_MODEL: (service_settings.quantization, service_settings.kv_cache_dtype),
        BUILTIN_EMBEDDING_MODEL: ("none", None),  # weights in its dtype, as /v1/workers shows; no KV cache
        "tiny-q4": ("q4", "fp8_e4m3"),  # vLLM's name shown canonical, as /v1/workers shows it
    }


def test_the_live_workers_report_what_they_run_over_the_configured_values(
    client: Any, service_settings: Settings
) -> None:
    service_settings.models = [
        *service_settings.models,
        ModelEntry(name="tiny", source="/m/tiny", quantization="int8", kv_cache_dtype="auto"),
    ]

    def shown() -> dict[str, tuple[str | None, str | None, str | None]]:
        body = client.get("/v1/models").json()["data"]
        return {m["id"]: (m["dtype"], m["quantization"], m["kv_cache_dtype"]) for m in body}

    configured = (service_settings.dtype, service_settings.quantization, service_settings.kv_cache_dtype)
    assert shown()["tiny"] == (service_settings.dtype, "int8", "auto")
    assert shown()[BUILTIN_MODEL] == configured
    assert shown()[BUILTIN_EMBEDDING_MODEL] == (None, "none", None)

    _beat(service_settings, 1, "tiny", engine=("bfloat16", "q4", "int8"))  # started with other settings
    _beat(service_settings, 2, "tiny", ready_s=None)  # still loading: reports nothing yet
    _beat(service_settings, 3, BUILTIN_EMBEDDING_MODEL, engine=("float32", "none", "auto"))
    assert shown()["tiny"] == ("bfloat16", "q4", "int8")
    assert shown()[BUILTIN_EMBEDDING_MODEL] == ("float32", "none", None)  # as its worker reports; no KV cache
    assert client.get("/v1/models/tiny").json()["quantization"] == "q4"

    _beat(service_settings, 2, "tiny", engine=("bfloat16", "none", "int8"))  # a rolling change: workers disagree
    assert shown()["tiny"] == ("bfloat16", "int8", "int8")  # the one they agree on, else the configured value
    assert shown()[BUILTIN_MODEL] == configured

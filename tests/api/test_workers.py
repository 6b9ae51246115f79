"""``GET /v1/workers``: live workers from their heartbeat rows; stale heartbeats are not listed."""

from __future__ import annotations

from typing import Any

from jobs import workers
from jobs.config import Settings
from jobs.db import session_scope
from jobs.status import now_s


def _beat(
    settings: Settings,
    worker_id: str,
    *,
    age_s: int,
    started_at: int,
    batch_id: str | None = None,
    kv_cache: workers.KVCacheSize | None = None,
    engine_format: workers.EngineFormat | None = None,
) -> None:
    host, pid = worker_id.split(":")
    with session_scope(settings.database_url) as session:
        workers.record_heartbeat(
            session,
            worker_id=worker_id,
            host=host,
            pid=int(pid),
            model="SmolLM2-135M-Instruct",
            device="cpu",
            current_batch_id=batch_id,
            num_running_requests=2 if batch_id else 0,
            tokens_per_s=12.5,
            metrics_port=9400,
            started_at=started_at,
            now=now_s() - age_s,
            kv_cache=kv_cache,
            engine_format=engine_format,
        )


def test_lists_live_workers_newest_first(client: Any, service_settings: Settings) -> None:
    assert client.get("/v1/workers").json() == {"object": "list", "data": []}
    _beat(service_settings, "a:1", age_s=1, started_at=100, batch_id="batch_1")
    _beat(service_settings, "b:2", age_s=2, started_at=200)
    _beat(service_settings, "c:3", age_s=int(service_settings.worker_live_s) + 5, started_at=300)  # stopped beating
    int8_cache = workers.KVCacheSize(kv_cache_dtype="int8", num_blocks=10965, num_bytes=10965 * 97920)
    q4_bf16 = workers.EngineFormat(dtype="bfloat16", quantization="q4")
    _beat(  # rewritten, the engine up
        service_settings, "a:1", age_s=0, started_at=100, batch_id="batch_2", kv_cache=int8_cache, engine_format=q4_bf16
    )

    body = client.get("/v1/workers").json()

    assert [w["id"] for w in body["data"]] == ["b:2", "a:1"]
    first = body["data"][1]
    assert first["object"] == "worker"
    assert (first["host"], first["pid"], first["device"], first["current_batch_id"]) == ("a", 1, "cpu", "batch_2")
    assert (first["num_running_requests"], first["tokens_per_s"], first["metrics_port"]) == (2, 12.5, 9400)
    assert abs(first["last_heartbeat_at"] - now_s()) <= 2
    assert (first["kv_cache_dtype"], first["num_kv_blocks"], first["kv_cache_bytes"]) == ("int8", 10965, 10965 * 97920)
    starting = body["data"][0]  # no engine yet: no cache to report
    assert (first["dtype"], first["quantization"]) == ("bfloat16", "q4")  # q4 on float32 would say so
    assert (starting["kv_cache_dtype"], starting["num_kv_blocks"], starting["kv_cache_bytes"]) == (None, None, None)
    assert (starting["dtype"], starting["quantization"]) == (None, None)

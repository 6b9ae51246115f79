"""Runner -> telemetry: Prometheus engine metrics and the worker heartbeat, with the stand-in engine.

The real engine's figures are checked against a live worker's scrape in tests/e2e/test_observability_e2e.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs import workers
from jobs.db import session_scope
from jobs.status import BatchStatus
from tests.e2e.processes import free_port
from tests.helpers.stand_in_engine import StandInEngine, run_batch
from tests.worker.test_runner import completion, make_batch, service  # noqa: F401
from worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from worker.engine.stats import EngineStats
from worker.metrics import EngineMetrics, serve_metrics, token_count_buckets
from worker.telemetry import (
    Heartbeat,
    WorkerActivity,
    WorkerTelemetry,
    engine_format,
    engine_kv_cache_size,
    process_started_at,
)


def scrape(registry) -> dict[str, float]:
    """``{sample name with labels: value}`` of the registry's exposition, parsed by prometheus_client."""
    from prometheus_client import generate_latest

    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_runner_feeds_step_stats_and_finished_requests_to_the_metrics(service, served_tokenizer):
    bodies = [completion(f"def f{i}(x):\n", max_tokens=3) for i in range(5)]
    batch_id = make_batch(bodies)
    telemetry = WorkerTelemetry(EngineMetrics("m"), WorkerActivity())
    seen_batch: list[str | None] = []
    engine = StandInEngine(
        served_tokenizer, max_num_seqs=2, on_step=lambda _: seen_batch.append(telemetry.activity.current_batch_id)
    )

    assert run_batch(batch_id, engine=engine, observer=telemetry) == BatchStatus.COMPLETED

    samples = scrape(telemetry.metrics.registry)
    assert samples["batchinfer:generation_tokens_total{}"] == 15
    assert samples["batchinfer:request_success_total{finished_reason=length}"] == 5
    assert samples["batchinfer:request_generation_tokens_count{}"] == 5
    assert samples["batchinfer:request_generation_tokens_sum{}"] == 15
    assert samples["batchinfer:num_requests_running{}"] == 0  # idle again after the batch
    assert set(seen_batch) == {batch_id} and telemetry.activity.current_batch_id is None
    assert telemetry.activity.tokens_per_s() > 0


def test_step_stats_map_to_vllm_names():
    metrics = EngineMetrics("m")
    stats = EngineStats(
        num_steps=1,
        num_generation_tokens=4,
        num_prompt_tokens=30,
        prefix_cache_queries=32,
        prefix_cache_hits=16,
        num_preemptions=1,
        kv_cache_usage=0.25,
        num_kv_blocks=1000,
        kv_cache_bytes=1000 * 69632,
        num_running_reqs=4,
        num_waiting_reqs=2,
        num_tokens_per_step=[20],
        time_to_first_tokens_s=[0.5, 0.7],
        inter_token_latencies_s=[0.05, 0.05],
    )
    metrics.record_step(stats)
    metrics.record_finished(
        RequestOutput(
            "r",
            None,
            [1, 2, 3],
            [CompletionOutput(0, "x", [5, 6], finish_reason="stop")],
            finished=True,
            metrics=RequestMetrics(10.0, 11.0, 12.5, 14.0, 14.25),
        )
    )
    samples = scrape(metrics.registry)
    expected = {
        "batchinfer:num_requests_running{}": 4,
        "batchinfer:num_requests_waiting{}": 2,
        "batchinfer:kv_cache_usage_perc{}": 0.25,
        "batchinfer:kv_cache_num_blocks{}": 1000,
        "batchinfer:kv_cache_bytes{}": 1000 * 69632,
        "batchinfer:prefix_cache_queries_total{}": 32,
        "batchinfer:prefix_cache_hits_total{}": 16,
        "batchinfer:num_preemptions_total{}": 1,
        "batchinfer:prompt_tokens_total{}": 30,
        "batchinfer:generation_tokens_total{}": 4,
        "batchinfer:iteration_tokens_total_sum{}": 20,
        "batchinfer:time_to_first_token_seconds_count{}": 2,
        "batchinfer:inter_token_latency_seconds_sum{}": 0.1,
        "batchinfer:e2e_request_latency_seconds_sum{}": 4.25,
        "batchinfer:request_queue_time_seconds_sum{}": 1.0,
        "batchinfer:request_prefill_time_seconds_sum{}": 1.5,
        "batchinfer:request_decode_time_seconds_sum{}": 1.5,
        "batchinfer:request_prompt_tokens_sum{}": 3,
        "batchinfer:request_success_total{finished_reason=stop}": 1,
    }
    assert {name: pytest.approx(samples[name]) for name in expected} == expected


def test_an_engine_without_a_kv_cache_shows_no_kv_cache_size():
    """An embedding model's steps carry no KV cache size: its scrape has no KV cache samples (not a usage or size
    of 0), as /v1/workers shows null for it; a generating engine's shows its usage from the start."""
    metrics = EngineMetrics("embedder")
    metrics.record_step(EngineStats(num_steps=1, num_running_reqs=3, num_prompt_tokens=40))
    samples = scrape(metrics.registry)
    assert samples["batchinfer:num_requests_running{}"] == 3
    assert not [name for name in samples if name.startswith("batchinfer:kv_cache")]
    generating = EngineMetrics("generator")
    generating.set_kv_cache_size(100, 100 * 69632)
    assert scrape(generating.registry)["batchinfer:kv_cache_usage_perc{}"] == 0


def test_spec_decoding_counters_map_to_vllm_names():
    metrics = EngineMetrics("m")
    for per_pos in ([3, 2], [1, 1, 1]):
        stats = EngineStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=sum(per_pos))
        stats.num_accepted_tokens_per_pos = per_pos
        stats.spec_decode_by_method = {"ngram": [2, 6, per_pos[0]], "eagle": [1, 3, sum(per_pos) - per_pos[0]]}
        metrics.record_step(stats)
    samples = scrape(metrics.registry)
    expected = {
        "batchinfer:spec_decode_num_drafts_total{}": 6,
        "batchinfer:spec_decode_num_draft_tokens_total{}": 18,
        "batchinfer:spec_decode_num_accepted_tokens_total{}": 8,
        "batchinfer:spec_decode_num_accepted_tokens_per_pos_total{position=0}": 4,
        "batchinfer:spec_decode_num_accepted_tokens_per_pos_total{position=1}": 3,
        "batchinfer:spec_decode_num_accepted_tokens_per_pos_total{position=2}": 1,
        "batchinfer:spec_decode_method_num_drafts_total{method=ngram}": 4,
        "batchinfer:spec_decode_method_num_drafts_total{method=eagle}": 2,
        "batchinfer:spec_decode_method_num_draft_tokens_total{method=eagle}": 6,
        "batchinfer:spec_decode_method_num_accepted_tokens_total{method=ngram}": 4,
        "batchinfer:spec_decode_method_num_accepted_tokens_total{method=eagle}": 4,
    }
    assert {name: samples[name] for name in expected} == expected


def test_token_count_buckets_follow_vllms_1_2_5_series():
    assert token_count_buckets(120) == (1, 2, 5, 10, 20, 50, 100)


def test_the_worker_port_serves_its_metrics():
    metrics = EngineMetrics("m")
    metrics.generation_tokens.inc(7)
    port = free_port()
    assert serve_metrics(metrics.registry, port, host="127.0.0.1")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'batchinfer:generation_tokens_total{model_name="m"} 7.0' in text
    assert not serve_metrics(metrics.registry, port, host="127.0.0.1")  # taken: reported, not raised


def test_activity_rate_counts_only_the_last_window():
    now = [100.0]
    activity = WorkerActivity(window_s=60, clock=lambda: now[0])
    now[0] = 110.0
    activity.add_tokens(50)  # 50 tokens in the 10 s since the activity began
    assert activity.tokens_per_s() == pytest.approx(5.0)
    now[0] = 200.0
    activity.add_tokens(60)
    assert activity.tokens_per_s() == pytest.approx(1.0)  # the first 50 fell out of the minute


def test_heartbeat_writes_then_removes_its_row(service):
    activity = WorkerActivity()
    activity.current_batch_id, activity.num_running_requests = "batch_x", 3
    heartbeat = Heartbeat(service, activity, model="m", device="cpu", metrics_port=9400, host="h", pid=42)
    heartbeat.kv_cache = workers.KVCacheSize(kv_cache_dtype="int8", num_blocks=7, num_bytes=7 * 97920)
    heartbeat.engine_format = workers.EngineFormat(dtype="bfloat16", quantization="q4")
    heartbeat.start()
    try:
        for _ in range(100):
            with session_scope() as session:
                live = workers.list_live_workers(session, now=heartbeat.started_at, live_s=30)
            if live:
                break
            threading.Event().wait(0.05)
        assert [(w.id, w.current_batch_id, w.num_running_requests, w.metrics_port) for w in live] == [
            ("h:42", "batch_x", 3, 9400)
        ]
        assert (live[0].kv_cache_dtype, live[0].num_kv_blocks, live[0].kv_cache_bytes) == ("int8", 7, 7 * 97920)
        assert (live[0].dtype, live[0].quantization) == ("bfloat16", "q4")
        with session_scope() as session:
            assert workers.list_live_workers(session, now=heartbeat.started_at + 31, live_s=30) == []
    finally:
        heartbeat.stop()
    with session_scope() as session:
        assert workers.list_live_workers(session, now=heartbeat.started_at, live_s=30) == []


def test_a_heartbeat_on_a_database_without_tables_warns_in_one_line_with_the_fix(tmp_path, caplog):
    from jobs.config import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}")
    heartbeat = Heartbeat(settings, WorkerActivity(), model="m", device="cpu", host="h", pid=7)
    with caplog.at_level("WARNING", logger="worker.telemetry"):
        heartbeat.mark_ready()
    [record] = [r for r in caplog.records if "heartbeat" in r.getMessage()]
    assert record.getMessage() == (
        "heartbeat: could not write worker h:7: no such table: workers "
        "(the database has no tables yet: run `batchinfer db upgrade` against it)"
    )


def test_the_engines_kv_cache_size_is_its_dtype_blocks_and_bytes(tmp_path):
    from tests.helpers.tiny_llama import save_tiny_llama
    from worker.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(save_tiny_llama(tmp_path)), kv_cache_dtype="int8"))
    runner = engine.model_runner

    assert engine_kv_cache_size(engine) == workers.KVCacheSize(
        kv_cache_dtype="int8", num_blocks=runner.num_blocks, num_bytes=runner.num_blocks * runner.bytes_per_block
    )
    assert engine_kv_cache_size(object()) is None  # not an LLMEngine (an embedding engine): no KV cache
    assert engine_format(engine) == workers.EngineFormat(dtype="float32", quantization="none")


def test_the_engines_format_is_its_loaded_dtype_and_quantization(tmp_path):
    """A generating engine reports the dtype its runner loaded and its quantization; an embedding engine its dtype
    and ``none`` (its weights are not quantized)."""
    from tests.helpers.tiny_llama import save_tiny_llama
    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.pooling_engine import EmbeddingEngineConfig, PoolingEngine

    model_dir = save_tiny_llama(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(model_dir), quantization="int8", kv_cache_memory_bytes=1 << 20))
    assert engine_format(engine) == workers.EngineFormat(dtype="float32", quantization="int8")
    embedder = PoolingEngine(EmbeddingEngineConfig(model=str(model_dir), dtype="bfloat16"))
    assert engine_format(embedder) == workers.EngineFormat(dtype="bfloat16", quantization="none")
    assert engine_format(object()) is None  # another engine (the e2e tests' stand-in): its row shows neither


def test_a_started_workers_scrape_shows_its_kv_cache_size_before_any_step(service, monkeypatch):
    """Once the engine is up, /metrics carries the KV cache's size (as /v1/workers does), not only after the first
    batch's first step; a worker without a KV cache (an embedder's) shows none."""
    import worker.telemetry as telemetry_module
    from worker.telemetry import start_worker_telemetry

    for kv_cache, expected in (
        (workers.KVCacheSize(kv_cache_dtype="int8", num_blocks=7, num_bytes=7 * 103680), [7, 7 * 103680]),
        (None, []),
    ):
        monkeypatch.setattr(telemetry_module, "_telemetry", None)  # a fresh process's telemetry
        heartbeat = Heartbeat(service, WorkerActivity(), model="m", device="cpu", host="h", pid=44)
        stop = start_worker_telemetry(service, heartbeat, device="cpu", max_model_len=64, kv_cache=kv_cache)
        try:
            samples = scrape(telemetry_module._telemetry.metrics.registry)
        finally:
            stop()
        sizes = [
            samples[name]
            for name in ("batchinfer:kv_cache_num_blocks{}", "batchinfer:kv_cache_bytes{}")
            if name in samples
        ]
        assert sizes == expected


def info_labels(registry, name: str = "batchinfer:model_config_info") -> list[tuple[dict[str, str], float]]:
    """The samples of info gauge ``name``: ``(labels, value)`` each."""
    from prometheus_client import generate_latest

    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == name
    ]


def test_a_started_workers_scrape_shows_its_model_config(service, monkeypatch):
    """Once the engine is up, /metrics carries ``model_config_info`` (value 1) labelled with the engine's dtype,
    quantization and KV cache dtype: q4 on bfloat16 and q4 on float32 differ; an embedder's has no KV cache dtype."""
    import worker.telemetry as telemetry_module
    from worker.telemetry import start_worker_telemetry

    int8_cache = workers.KVCacheSize(kv_cache_dtype="int8", num_blocks=7, num_bytes=7 * 103680)
    model = service.served_model_name
    for kv_cache, fmt, expected in (
        (
            int8_cache,
            workers.EngineFormat(dtype="bfloat16", quantization="q4"),
            {"model_name": model, "dtype": "bfloat16", "quantization": "q4", "kv_cache_dtype": "int8"},
        ),
        (
            None,
            workers.EngineFormat(dtype="float32", quantization="none"),
            {
                "model_name": model,
                "dtype": "float32",
                "quantization": "none",
                "kv_cache_dtype": "",
            },  # Prometheus: absent
        ),
    ):
        monkeypatch.setattr(telemetry_module, "_telemetry", None)  # a fresh process's telemetry
        heartbeat = Heartbeat(service, WorkerActivity(), model="m", device="cpu", host="h", pid=45)
        stop = start_worker_telemetry(
            service, heartbeat, device="cpu", max_model_len=64, kv_cache=kv_cache, engine_format=fmt
        )
        try:
            assert heartbeat.engine_format == fmt
            assert info_labels(telemetry_module._telemetry.metrics.registry) == [(expected, 1.0)]
        finally:
            stop()


def test_a_heartbeat_says_starting_until_the_worker_marks_itself_ready(service):
    heartbeat = Heartbeat(service, WorkerActivity(), model="m", device="auto", host="h", pid=43)
    heartbeat.beat()  # what the thread writes first, while the model loads
    with session_scope() as session:
        row = session.get(workers.Worker, "h:43")
        assert row.ready_s is None
        readiness = workers.worker_readiness(session, now=heartbeat.started_at, live_s=30)
    assert readiness == workers.WorkerReadiness(num_ready=0, num_starting=1)
    assert readiness.waiting_note() == "waiting: no worker is ready (1 starting)"

    ready_s = heartbeat.mark_ready(started_at=time.time() - 4.0)  # written at once, not at the next beat

    assert 4.0 <= ready_s < 30
    with session_scope() as session:
        assert session.get(workers.Worker, "h:43").ready_s == ready_s
        readiness = workers.worker_readiness(session, now=heartbeat.started_at, live_s=30)
        assert [w.pid for w in workers.ready_workers(session, host="h", pids=[43, 44])] == [43]
    assert readiness == workers.WorkerReadiness(num_ready=1, num_starting=0) and readiness.waiting_note() is None
    assert workers.WorkerReadiness(num_ready=0, num_starting=0).waiting_note() == (
        "waiting: no worker is ready (none running)"
    )


def test_process_start_is_before_now_and_after_boot():
    started_at = process_started_at()
    assert time.time() - 3600 * 24 * 365 < started_at <= time.time()


_CHILD = """
import sys
from worker.engine.stats import EngineStats
from worker.metrics import EngineMetrics
running, tokens = int(sys.argv[1]), int(sys.argv[2])
metrics = EngineMetrics("m")
metrics.record_step(
    EngineStats(
        num_steps=1, num_running_reqs=running, num_generation_tokens=tokens, kv_cache_usage=running / 10, num_kv_blocks=10
    )
)
metrics.set_model_config(sys.argv[3], "q4", "auto")
"""


def test_multiprocess_mode_serves_the_hosts_processes_together(tmp_path, monkeypatch):
    """Two worker processes sharing PROMETHEUS_MULTIPROC_DIR: one scrape sums their counters and live
    gauges (KV usage: the maximum; ``model_config_info``: one sample a configuration, 1); a process marked dead
    leaves the live gauges."""
    import os
    import subprocess
    import sys

    from prometheus_client import generate_latest

    from tests.helpers.monitoring import parse_scrape, sample_value
    from worker.metrics import exposition_registry, mark_process_dead

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for running, tokens, dtype in ((2, 5, "bfloat16"), (3, 7, "float32")):
        subprocess.run([sys.executable, "-c", _CHILD, str(running), str(tokens), dtype], env=env, check=True)
    pids = sorted(int(path.stem.rsplit("_", 1)[1]) for path in tmp_path.glob("gauge_livesum_*.db"))
    assert len(pids) == 2
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def scrape():
        return parse_scrape(generate_latest(exposition_registry(EngineMetrics("unused").registry)).decode())

    both = scrape()
    assert sample_value(both, "batchinfer:generation_tokens_total") == 12
    assert sample_value(both, "batchinfer:num_requests_running") == 5
    assert sample_value(both, "batchinfer:kv_cache_usage_perc") == pytest.approx(0.3)
    info = [(s.labels["dtype"], s.value) for s in both["batchinfer:model_config_info"].samples]
    assert sorted(info) == [("bfloat16", 1), ("float32", 1)]  # q4 on bfloat16 and on float32 told apart
    mark_process_dead(pids[0])
    one_left = scrape()
    assert sample_value(one_left, "batchinfer:generation_tokens_total") == 12  # counters keep what was counted
    assert sample_value(one_left, "batchinfer:num_requests_running") in (2, 3)
    assert [s.value for s in one_left["batchinfer:model_config_info"].samples] == [1]

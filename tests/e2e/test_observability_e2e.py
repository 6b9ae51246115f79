"""A live worker's engine metrics on the real model (SmolLM2), scraped from its own port while a job runs.

API and worker run as child processes (PostgreSQL, Redis); the worker runs in prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) and serves ``BATCHINFER_WORKER_METRICS_PORT``.
Checks: every vLLM-named metric is there with vLLM's type, counters move while the job runs, the
figures agree with what the engine reported per line (usage in the output file), ``GET /v1/workers``
shows the worker on the batch, and every metric the Grafana dashboard queries is in the scrapes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import child_env, cli, free_port, running, wait_for_batch, wait_for_health
from tests.e2e.served.test_service_e2e import _jsonl, _read
from tests.helpers.monitoring import dashboard_metric_names, parse_scrape, sample_names, sample_value
from tests.helpers.service import postgres_url  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

# family name (as prometheus_client's parser names it: counters without _total) -> type, as vLLM has them
ENGINE_METRICS = {
    "batchinfer:num_requests_running": "gauge",
    "batchinfer:num_requests_waiting": "gauge",
    "batchinfer:kv_cache_usage_perc": "gauge",
    "batchinfer:prefix_cache_queries": "counter",
    "batchinfer:prefix_cache_hits": "counter",
    "batchinfer:num_preemptions": "counter",
    "batchinfer:prompt_tokens": "counter",
    "batchinfer:generation_tokens": "counter",
    "batchinfer:request_success": "counter",
    "batchinfer:iteration_tokens_total": "histogram",
    "batchinfer:time_to_first_token_seconds": "histogram",
    "batchinfer:inter_token_latency_seconds": "histogram",
    "batchinfer:e2e_request_latency_seconds": "histogram",
    "batchinfer:request_queue_time_seconds": "histogram",
    "batchinfer:request_prefill_time_seconds": "histogram",
    "batchinfer:request_decode_time_seconds": "histogram",
    "batchinfer:request_prompt_tokens": "histogram",
    "batchinfer:request_generation_tokens": "histogram",
}
NUM_LINES, MAX_TOKENS = 24, 24
PREAMBLE = "You are a careful Python programmer. Answer with code only, no prose. " * 4


def test_worker_metrics_follow_a_running_job(tmp_path, postgres_url, redis_url):
    from openai import OpenAI

    api_port, metrics_port = free_port(), free_port()
    multiproc_dir = tmp_path / "prometheus"
    multiproc_dir.mkdir()
    env = child_env(
        data_dir=str(tmp_path / "data"),
        database_url=postgres_url,
        broker_url=redis_url,
        worker_metrics_port=str(metrics_port),
        worker_metrics_host="127.0.0.1",
        worker_heartbeat_s="1",
        max_num_seqs="8",
    )
    env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    api_log, worker_log = tmp_path / "api.log", tmp_path / "worker.log"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with (
        running(cli("api", "--host", "127.0.0.1", "--port", str(api_port)), env, api_log) as api,
        running(cli("worker"), env, worker_log) as worker,
    ):
        base_url = f"http://127.0.0.1:{api_port}"
        wait_for_health(base_url, api, api_log)
        _wait_for(lambda: httpx.get(metrics_url, timeout=2).status_code == 200, worker, worker_log, timeout_s=300)
        before = parse_scrape(httpx.get(metrics_url, timeout=5).text)
        for name, kind in ENGINE_METRICS.items():
            assert name in before and before[name].type == kind, f"{name}: {before.get(name)}"

        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": BUILTIN_MODEL,
                    "prompt": f"{PREAMBLE}\ndef function_{i}(x):",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            for i in range(NUM_LINES)
        ]
        input_file = client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/completions", completion_window="24h")

        # while it runs: generation counter moves between scrapes, the worker lists the batch as current
        seen_tokens: list[float] = []
        seen_running, seen_on_batch = 0.0, False
        deadline = time.monotonic() + 600
        while client.batches.retrieve(batch.id).status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, worker_log.read_text()[-4000:]
            during = parse_scrape(httpx.get(metrics_url, timeout=5).text)
            seen_tokens.append(sample_value(during, "batchinfer:generation_tokens_total"))
            seen_running = max(seen_running, sample_value(during, "batchinfer:num_requests_running"))
            live = httpx.get(f"{base_url}/v1/workers", timeout=5).json()["data"]
            seen_on_batch |= any(w["current_batch_id"] == batch.id and w["metrics_port"] == metrics_port for w in live)
            time.sleep(0.5)
        batch = wait_for_batch(client, batch.id, 60, [api_log, worker_log])
        after = parse_scrape(httpx.get(metrics_url, timeout=5).text)
        api_scrape = parse_scrape(httpx.get(f"{base_url}/metrics", timeout=5).text)
        usage = [entry["response"]["body"]["usage"] for entry in _read(client, batch.output_file_id).values()]

    assert batch.status == "completed" and batch.request_counts.completed == NUM_LINES
    assert len({v for v in seen_tokens if 0 < v < NUM_LINES * MAX_TOKENS}) >= 2, f"counter did not move: {seen_tokens}"
    assert 0 < seen_running <= 8
    assert seen_on_batch, "GET /v1/workers never showed the worker on the batch"

    num_prompt = sum(u["prompt_tokens"] for u in usage)
    num_output = sum(u["completion_tokens"] for u in usage)
    num_cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert num_output == NUM_LINES * MAX_TOKENS and num_cached > 0  # the shared preamble hit the prefix cache

    def value(name: str, **labels: str) -> float:
        return sample_value(after, name, **labels)

    assert value("batchinfer:generation_tokens_total") == num_output
    assert value("batchinfer:prompt_tokens_total") == num_prompt
    assert value("batchinfer:prefix_cache_hits_total") >= num_cached
    assert value("batchinfer:prefix_cache_queries_total") >= value("batchinfer:prefix_cache_hits_total") > 0
    assert value("batchinfer:request_success_total", finished_reason="length") == NUM_LINES
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(f"batchinfer:{histogram}_count") == NUM_LINES, histogram
    # One observation per step that gave a line tokens after its first (vLLM's rule): a verification that
    # accepted a drafts gave a + 1 tokens in one step (the worker speculates while few lines run).
    accepted = value("batchinfer:spec_decode_num_accepted_tokens_total")
    assert value("batchinfer:inter_token_latency_seconds_count") == num_output - NUM_LINES - accepted
    assert value("batchinfer:request_generation_tokens_sum") == num_output
    assert value("batchinfer:iteration_tokens_total_sum") >= num_prompt - num_cached + num_output - NUM_LINES
    assert value("batchinfer:e2e_request_latency_seconds_sum") >= value("batchinfer:time_to_first_token_seconds_sum")
    assert value("batchinfer:num_requests_running") == value("batchinfer:num_requests_waiting") == 0
    assert 0 <= value("batchinfer:kv_cache_usage_perc") <= 1

    missing = dashboard_metric_names() - sample_names(after) - sample_names(api_scrape)
    assert not missing, f"the dashboard queries metrics no scrape has: {sorted(missing)}"


def _wait_for(check, process, log_path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the worker exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the worker's metrics port did not answer within {timeout_s} s:\n{log_path.read_text()[-4000:]}")

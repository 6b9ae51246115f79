"""Engine metrics under vLLM's names and meanings, prefix ``batchinfer:`` (docs/architecture.md, "Observability").

The runner feeds them after every engine step (`EngineMetrics.record_step` with the engine's
take-and-reset `EngineStats`) and for every finished request (`EngineMetrics.record_finished` with its
`RequestMetrics` times). Every series carries the ``model_name`` label, as vLLM's do.

| metric | type | vLLM meaning |
|---|---|---|
| ``batchinfer:num_requests_running`` / ``num_requests_waiting`` | gauge | sequences in the batch / queued |
| ``batchinfer:kv_cache_usage_perc`` | gauge | fraction of KV blocks in use (0..1); none without a KV cache |
| ``batchinfer:kv_cache_num_blocks`` / ``kv_cache_bytes`` | gauge | (ours) the KV cache's size: blocks, and bytes (scales included) |
| ``batchinfer:model_config_info`` | gauge | (ours, vLLM's info style) 1; labels ``dtype``, ``quantization``, ``kv_cache_dtype`` |
| ``batchinfer:prefix_cache_queries_total`` / ``prefix_cache_hits_total`` | counter | prompt tokens looked up / found |
| ``batchinfer:num_preemptions_total`` | counter | running sequences sent back to recompute |
| ``batchinfer:prompt_tokens_total`` / ``generation_tokens_total`` | counter | prefill tokens (per request) / sampled tokens |
| ``batchinfer:iteration_tokens_total`` | histogram | tokens scheduled per engine step |
| ``batchinfer:time_to_first_token_seconds`` | histogram | arrival to first token |
| ``batchinfer:inter_token_latency_seconds`` | histogram | between a request's consecutive steps that gave it tokens |
| ``batchinfer:e2e_request_latency_seconds`` | histogram | arrival to finish |
| ``batchinfer:request_queue_time_seconds`` | histogram | arrival to first scheduled |
| ``batchinfer:request_prefill_time_seconds`` | histogram | first scheduled to first token |
| ``batchinfer:request_decode_time_seconds`` | histogram | first to last token |
| ``batchinfer:request_prompt_tokens`` / ``request_generation_tokens`` | histogram | per finished request |
| ``batchinfer:request_success_total`` | counter | finished requests by ``finished_reason`` |
| ``batchinfer:resumed_tokens_total`` | counter | (ours) generated tokens restored from line checkpoints |
| ``batchinfer:recomputed_tokens_total`` | counter | (ours) generated tokens an interrupted line threw away (not preemptions) |
| ``batchinfer:spec_decode_num_drafts_total`` | counter | sequence-steps that verified draft tokens |
| ``batchinfer:spec_decode_num_draft_tokens_total`` | counter | draft tokens verified |
| ``batchinfer:spec_decode_num_accepted_tokens_total`` | counter | draft tokens accepted |
| ``batchinfer:spec_decode_num_accepted_tokens_per_pos_total`` | counter | accepted drafts by draft ``position`` (0-based) |
| ``batchinfer:spec_decode_method_num_drafts_total`` | counter | the drafts of one ``method`` (ngram, eagle, medusa, draft) |
| ``batchinfer:spec_decode_method_num_draft_tokens_total`` | counter | draft tokens verified, by ``method`` |
| ``batchinfer:spec_decode_method_num_accepted_tokens_total`` | counter | draft tokens accepted, by ``method`` |

Processes: metrics live in a `CollectorRegistry` of this process. When ``PROMETHEUS_MULTIPROC_DIR``
is set before the process starts, prometheus_client keeps every value in files of that folder, and
`exposition_registry` aggregates all processes of the host (gauges: ``livesum``, KV usage ``livemax``).
`serve_metrics` exposes it on the worker's own port, so Prometheus scrapes each host (or container).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import multiprocess as prometheus_multiprocess

from worker.engine.outputs import RequestOutput
from worker.engine.stats import EngineStats

logger = logging.getLogger(__name__)

PREFIX = "batchinfer:"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours alike.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_value``: 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """The engine's Prometheus metrics for one served model, registered in ``registry`` (default: a new one)."""

    def __init__(self, model_name: str, *, max_model_len: int = 8192, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = [model_name]

        def gauge_family(name: str, documentation: str, mode: Literal["livesum", "livemax"]) -> Gauge:
            """The gauge, not yet labelled: its model's sample appears once set (`gauge` labels it, showing 0 at once)."""
            return Gauge(PREFIX + name, documentation, ["model_name"], registry=self.registry, multiprocess_mode=mode)

        def gauge(name: str, documentation: str, mode: Literal["livesum", "livemax"]) -> Any:
            return gauge_family(name, documentation, mode).labels(*labels)

        def counter(name: str, documentation: str) -> Any:
            return Counter(PREFIX + name, documentation, ["model_name"], registry=self.registry).labels(*labels)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Any:
            return Histogram(
                PREFIX + name, documentation, ["model_name"], registry=self.registry, buckets=buckets
            ).labels(*labels)

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches.", "livesum"
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.", "livesum"
        )
        # NOTE: the KV cache gauges (usage and size) get their model's sample only once an engine with a KV cache
        # reports one: an embedding model's worker shows none (as /v1/workers shows null), not a usage or size of 0.
        self._kv_cache_usage = gauge_family(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "livemax"
        )
        self._kv_cache_num_blocks = gauge_family("kv_cache_num_blocks", "KV-cache size in blocks.", "livesum")
        self._kv_cache_bytes = gauge_family(
            "kv_cache_bytes", "KV-cache size in bytes (all layers, K and V, scales included).", "livesum"
        )
        # NOTE: an info gauge (always 1, the facts in its labels), set once the engine is up. livemax: a host's
        # processes of one configuration show one sample, of two configurations two, and a stopped one's goes.
        self._model_config_info = Gauge(
            PREFIX + "model_config_info",
            "The engine's configuration: compute dtype, weight quantization, KV cache dtype (empty: no KV cache).",
            ["model_name", "dtype", "quantization", "kv_cache_dtype"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.resumed_tokens = counter(
            "resumed_tokens", "Generated tokens restored from line checkpoints (prefilled, not generated again)."
        )
        self.recomputed_tokens = counter(
            "recomputed_tokens", "Generated tokens thrown away by interrupted lines after their last checkpoint."
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS_S
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        request_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # NOTE: one child per reason up front (as vLLM does), so every series exists from the first scrape.
        self.request_success = {reason: request_success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._by_method = [
            Counter(PREFIX + f"spec_decode_method_{name}", help_text, ["model_name", "method"], registry=self.registry)
            for name, help_text in (
                ("num_drafts", "Spec decoding drafts by method."),
                ("num_draft_tokens", "Draft tokens by method."),
                ("num_accepted_tokens", "Accepted tokens by method."),
            )
        ]
        self._model_name = model_name

    def record_step(self, stats: EngineStats) -> None:
        """Add one window of engine statistics (usually one step's) to the counters; set the gauges."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        if stats.num_kv_blocks:
            self.set_kv_cache_size(stats.num_kv_blocks, stats.kv_cache_bytes)
            if stats.num_steps:
                self._kv_cache_usage.labels(self._model_name).set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for num_tokens in stats.num_tokens_per_step:
            self.iteration_tokens.observe(num_tokens)
        for ttft_s in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft_s)
        for itl_s in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl_s)
        self.spec_decode_num_drafts.inc(stats.num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, num_accepted in enumerate(stats.num_accepted_tokens_per_pos):
            self._accepted_per_pos.labels(self._model_name, str(position)).inc(num_accepted)
        for method, counts in stats.spec_decode_by_method.items():
            for counter_, count in zip(self._by_method, counts, strict=True):
                counter_.labels(self._model_name, method).inc(count)

    def record_finished(self, output: RequestOutput) -> None:
        """Observe a finished request's latencies and sizes (from ``output.metrics``, monotonic seconds)."""
        times = output.metrics
        num_generated = sum(len(completion.token_ids) for completion in output.outputs)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_generated)
        for completion in output.outputs:
            self.request_success[completion.finish_reason or "abort"].inc()
        if times is None:
            return
        if times.finished_time is not None:
            self.e2e_request_latency.observe(times.finished_time - times.arrival_time)
        if times.first_scheduled_time is not None:
            self.request_queue_time.observe(times.first_scheduled_time - times.arrival_time)
            if times.first_token_time is not None:
                self.request_prefill_time.observe(times.first_token_time - times.first_scheduled_time)
        if times.first_token_time is not None and times.last_token_time is not None:
            self.request_decode_time.observe(times.last_token_time - times.first_token_time)

    def set_kv_cache_size(self, num_blocks: int, num_bytes: int) -> None:
        """Set the KV cache's size gauges (blocks; bytes, scales included): once the engine is up, so a scrape
        shows them (and its usage, 0 until a step sets it) before the first batch, and again with every step's
        statistics."""
        self._kv_cache_usage.labels(self._model_name)  # its sample shows from now (0 until a step sets it)
        self._kv_cache_num_blocks.labels(self._model_name).set(num_blocks)
        self._kv_cache_bytes.labels(self._model_name).set(num_bytes)

    def set_model_config(self, dtype: str, quantization: str, kv_cache_dtype: str | None) -> None:
        """Set ``model_config_info`` (value 1) for the engine's compute ``dtype`` (torch's name), weight
        ``quantization`` and ``kv_cache_dtype`` (None: an engine without a KV cache, an embedding model's; the
        label is then empty, which Prometheus reads as absent)."""
        self._model_config_info.labels(self._model_name, dtype, quantization, kv_cache_dtype or "").set(1)

    def set_idle(self) -> None:
        """Zero the gauges between batches (nothing running, nothing waiting)."""
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when set (prometheus_client reads it when first imported)."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def exposition_registry(own: CollectorRegistry) -> CollectorRegistry:
    """What a scrape should see: every process of the host in multiprocess mode, else ``own``."""
    directory = multiprocess_dir()
    if directory is None:
        return own
    registry = CollectorRegistry()
    prometheus_multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry


def serve_metrics(own: CollectorRegistry, port: int, host: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread (prometheus_client's server); False when taken.

    In multiprocess mode the port serves the whole host, so a second worker of the host finding it
    taken is expected (its figures are in the first one's scrape); otherwise it is logged as a warning.
    """
    try:
        start_http_server(port, addr=host, registry=exposition_registry(own))
    except OSError as exc:
        level = logging.INFO if multiprocess_dir() else logging.WARNING
        logger.log(level, "worker metrics: port %d not served by this process (%s)", port, exc)
        return False
    logger.info("worker metrics on http://%s:%d/metrics", host, port)
    return True


def mark_process_dead(pid: int) -> None:
    """Drop a stopped process's live gauges from the multiprocess files (no-op outside multiprocess mode)."""
    directory = multiprocess_dir()
    if directory is not None:
        prometheus_multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]

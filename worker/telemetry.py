"""What a worker tells the outside: Prometheus engine metrics and its heartbeat row (docs/architecture.md, "Observability").

`WorkerTelemetry` is the runner's `worker.runner.StepObserver`: after every engine step it feeds
`worker.metrics.EngineMetrics` and `WorkerActivity` (current batch, running requests, generation
tokens over the last minute). `Heartbeat` writes that activity to the ``workers`` table every
``Settings.worker_heartbeat_s`` seconds from a daemon thread (`jobs.workers.record_heartbeat`).

A worker process starts its heartbeat first (`start_heartbeat`: the row says *starting* while the
model loads), attaches the engine's telemetry once the engine is up (`start_worker_telemetry`) and
marks itself ready when Celery consumes (`Heartbeat.mark_ready`: ``ready_s``, the seconds since the
process started, written at once). The reaper treats a worker whose heartbeat stopped as dead
(`jobs.shards`), and the status views say when no worker is ready (`jobs.workers.worker_readiness`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from jobs import workers
from jobs.config import Settings
from jobs.db import session_scope
from worker.engine.outputs import RequestOutput
from worker.engine.stats import EngineStats
from worker.metrics import EngineMetrics

logger = logging.getLogger(__name__)

TOKENS_WINDOW_S = 60.0


@dataclass(slots=True)
class WorkerActivity:
    """The worker's current batch and recent throughput (thread-safe enough: the heartbeat only reads).

    ``tokens_per_s`` divides the generation tokens of the last ``window_s`` seconds by ``window_s``
    (or by the time since the activity began, when shorter), all in `time.monotonic` seconds.
    """

    window_s: float = TOKENS_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    current_batch_id: str | None = None
    num_running_requests: int = 0
    began_s: float = field(init=False)
    _tokens: deque[tuple[float, int]] = field(init=False, default_factory=deque)

    def __post_init__(self) -> None:
        self.began_s = self.clock()

    def add_tokens(self, num_tokens: int) -> None:
        if num_tokens:
            self._tokens.append((self.clock(), num_tokens))

    def tokens_per_s(self) -> float:
        now = self.clock()
        while self._tokens and self._tokens[0][0] < now - self.window_s:
            self._tokens.popleft()
        span_s = min(self.window_s, now - self.began_s)
        return sum(num for _, num in self._tokens) / span_s if span_s > 0 else 0.0


class WorkerTelemetry:
    """The runner's step observer for this process: Prometheus metrics plus the heartbeat's activity."""

    def __init__(self, metrics: EngineMetrics, activity: WorkerActivity | None = None) -> None:
        self.metrics = metrics
        self.activity = activity or WorkerActivity()

    def batch_started(self, batch_id: str) -> None:
        self.activity.current_batch_id = batch_id

    def step_done(self, stats: EngineStats, finished: list[RequestOutput]) -> None:
        self.metrics.record_step(stats)
        for output in finished:
            self.metrics.record_finished(output)
        self.activity.add_tokens(stats.num_generation_tokens)
        self.activity.num_running_requests = stats.num_running_reqs

    def batch_ended(self) -> None:
        self.activity.current_batch_id = None
        self.activity.num_running_requests = 0
        self.metrics.set_idle()

    def tokens_resumed(self, num_tokens: int) -> None:
        self.metrics.resumed_tokens.inc(num_tokens)

    def tokens_recomputed(self, num_tokens: int) -> None:
        self.metrics.recomputed_tokens.inc(num_tokens)


_telemetry: WorkerTelemetry | None = None
_lock = threading.Lock()


def get_telemetry(model_name: str, max_model_len: int = 8192) -> WorkerTelemetry:
    """This process's telemetry (one `EngineMetrics` per process: metric names register once)."""
    global _telemetry
    with _lock:
        if _telemetry is None:
            _telemetry = WorkerTelemetry(EngineMetrics(model_name, max_model_len=max_model_len))
        return _telemetry


def process_started_at() -> float:
    """When this process started, in Unix seconds (Linux: ``/proc/self/stat``'s start time, 10 ms grain;
    elsewhere the time this module was imported)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT
    return time.time() - age_s


_IMPORTED_AT = time.time()


@dataclass(slots=True)
class Heartbeat:
    """Rewrites this process's ``workers`` row every ``settings.worker_heartbeat_s`` seconds until `stop`
    (which deletes it). ``ready_s`` stays None (the row says *starting*) until `mark_ready`; ``kv_cache`` and
    ``engine_format`` until the engine is up (`start_worker_telemetry`)."""

    settings: Settings
    activity: WorkerActivity
    model: str
    device: str
    metrics_port: int | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started_at: int = field(default_factory=lambda: int(time.time()))
    ready_s: float | None = None
    kv_cache: workers.KVCacheSize | None = None
    engine_format: workers.EngineFormat | None = None
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, default=None)

    @property
    def worker_id(self) -> str:
        return f"{self.host}:{self.pid}"

    def beat(self) -> None:
        """Write the row once (the current activity, ``last_heartbeat_at`` = now)."""
        with session_scope(self.settings.database_url) as session:
            workers.record_heartbeat(
                session,
                worker_id=self.worker_id,
                host=self.host,
                pid=self.pid,
                model=self.model,
                device=self.device,
                current_batch_id=self.activity.current_batch_id,
                num_running_requests=self.activity.num_running_requests,
                tokens_per_s=round(self.activity.tokens_per_s(), 3),
                metrics_port=self.metrics_port,
                started_at=self.started_at,
                now=int(time.time()),
                ready_s=self.ready_s,
                kv_cache=self.kv_cache,
                engine_format=self.engine_format,
            )

    def mark_ready(self, started_at: float | None = None) -> float:
        """Record that the worker takes work from now on: ``ready_s`` = seconds since ``started_at`` (Unix
        seconds; default the process's start), written at once (a failed write is retried by the next
        beat). Returns ``ready_s``."""
        self.ready_s = round(time.time() - (process_started_at() if started_at is None else started_at), 2)
        logger.info("worker ready (model %s) in %.1f s", self.model, self.ready_s)
        try:
            self.beat()
        except Exception as exc:
            logger.warning("heartbeat: could not write worker %s: %s", self.worker_id, database_problem(exc))
        return self.ready_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and delete the row (a clean shutdown leaves no stale worker behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            with session_scope(self.settings.database_url) as session:
                workers.remove_worker(session, worker_id=self.worker_id)
        except Exception as exc:
            logger.warning("heartbeat: could not remove worker %s: %s", self.worker_id, database_problem(exc))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:
                # NOTE: a database hiccup must not kill the thread; the row just ages until the next beat.
                logger.warning("heartbeat: could not write worker %s: %s", self.worker_id, database_problem(exc))
            self._stop.wait(self.settings.worker_heartbeat_s)


def database_problem(exc: Exception) -> str:
    """``exc`` in one line: a database error as its driver's first line (SQLAlchemy's own message appends the
    statement, its parameters and a link), with the fix where the tables are missing (a database never migrated:
    SQLite's "no such table", PostgreSQL's undefined table); any other exception as ``str(exc)``."""
    from sqlalchemy.exc import DBAPIError, ProgrammingError

    if not isinstance(exc, DBAPIError) or exc.orig is None:
        return str(exc)
    message = (str(exc.orig).splitlines() or [type(exc.orig).__name__])[0]
    if "no such table" in message or (isinstance(exc, ProgrammingError) and "does not exist" in message):
        message += " (the database has no tables yet: run `batchinfer db upgrade` against it)"
    return message


def start_heartbeat(settings: Settings) -> Heartbeat:
    """For a worker process, first thing: start its heartbeat (row *starting*; the device as configured
    until `start_worker_telemetry` names the engine's). Stop it with `Heartbeat.stop`."""
    heartbeat = Heartbeat(settings, WorkerActivity(), model=settings.served_model_name, device=settings.device)
    heartbeat.start()
    return heartbeat


def engine_kv_cache_size(engine: object) -> workers.KVCacheSize | None:
    """A generating engine's KV cache (`worker.engine.llm_engine.LLMEngine`: its ``kv_cache_dtype``, blocks and
    bytes); None for an engine without one (`worker.engine.pooling_engine.PoolingEngine`)."""
    from worker.engine.llm_engine import LLMEngine  # NOTE: here: the engine (and torch) is loaded by now

    if not isinstance(engine, LLMEngine):
        return None
    runner = engine.model_runner
    return workers.KVCacheSize(
        kv_cache_dtype=engine.config.kv_cache_dtype,
        num_blocks=runner.num_blocks,
        num_bytes=runner.num_blocks * runner.bytes_per_block,
    )


def engine_format(engine: object) -> workers.EngineFormat | None:
    """An engine's compute dtype (torch's name) and weight quantization: a generating engine's
    (`worker.engine.llm_engine.LLMEngine`) as its model runner loaded it; an embedding engine's
    (`worker.engine.pooling_engine.PoolingEngine`) quantization is ``none`` (its weights are in its dtype);
    None for any other engine (a test's stand-in), whose row then shows neither."""
    # NOTE: imported here: the engine (and torch) is loaded by now
    from worker.engine.llm_engine import LLMEngine as Generating
    from worker.engine.pooling_engine import PoolingEngine as Pooling

    if isinstance(engine, Generating):
        return workers.EngineFormat(
            dtype=_dtype_name(engine.model_runner.dtype), quantization=engine.config.quantization
        )
    if isinstance(engine, Pooling):
        return workers.EngineFormat(dtype=_dtype_name(engine.dtype), quantization="none")
    return None


def _dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def start_worker_telemetry(
    settings: Settings,
    heartbeat: Heartbeat,
    *,
    device: str,
    max_model_len: int,
    kv_cache: workers.KVCacheSize | None = None,
    engine_format: workers.EngineFormat | None = None,
) -> Callable[[], None]:
    """For a worker process whose engine is up: serve ``/metrics`` on ``settings.worker_metrics_port``
    (when set) and let ``heartbeat`` report the engine's device, KV cache (None: an engine without one, an
    embedding model's), dtype and quantization (``engine_format``; also the ``model_config_info`` gauge) and
    activity; returns the function to call on shutdown (removes the row, drops live gauges)."""
    from worker.metrics import mark_process_dead, serve_metrics

    telemetry = get_telemetry(settings.served_model_name, max_model_len)
    port = settings.worker_metrics_port
    if port is not None and not serve_metrics(telemetry.metrics.registry, port, settings.worker_metrics_host):
        port = None
    heartbeat.activity, heartbeat.device, heartbeat.metrics_port = telemetry.activity, device, port
    heartbeat.kv_cache, heartbeat.engine_format = kv_cache, engine_format
    if engine_format is not None:
        telemetry.metrics.set_model_config(
            engine_format.dtype, engine_format.quantization, None if kv_cache is None else kv_cache.kv_cache_dtype
        )
    if kv_cache is not None:  # NOTE: now, not at the first step: /metrics shows the size while the worker idles
        telemetry.metrics.set_kv_cache_size(kv_cache.num_blocks, kv_cache.num_bytes)

    def stop() -> None:
        heartbeat.stop()
        mark_process_dead(heartbeat.pid)

    return stop

"""What a worker tells the outside: Prometheus engine metrics and its heartbeat row (docs/architecture.md, "Observability").

`WorkerTelemetry` is the runner's `worker.runner.StepObserver`: after every engine step it feeds
`worker.metrics.EngineMetrics` and `WorkerActivity` (current batch, running requests, generation
tokens over the last minute). `Heartbeat` writes that activity to the ``workers`` table every
``Settings.worker_heartbeat_s`` seconds from a daemon thread (`jobs.workers.record_heartbeat`).
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


@dataclass(slots=True)
class Heartbeat:
    """Rewrites this process's ``workers`` row every ``interval_s`` seconds until `stop` (which deletes it)."""

    settings: Settings
    activity: WorkerActivity
    model: str
    device: str
    metrics_port: int | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started_at: int = field(default_factory=lambda: int(time.time()))
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
            )

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
            logger.warning("heartbeat: could not remove worker %s: %s", self.worker_id, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:
                # NOTE: a database hiccup must not kill the thread; the row just ages until the next beat.
                logger.warning("heartbeat: could not write worker %s: %s", self.worker_id, exc)
            self._stop.wait(self.settings.worker_heartbeat_s)


def start_worker_telemetry(settings: Settings, *, device: str, max_model_len: int) -> Callable[[], None]:
    """For a worker process: serve ``/metrics`` on ``settings.worker_metrics_port`` (when set) and start
    the heartbeat; returns the function to call on shutdown (removes the row, drops live gauges)."""
    from worker.metrics import mark_process_dead, serve_metrics

    telemetry = get_telemetry(settings.served_model_name, max_model_len)
    port = settings.worker_metrics_port
    if port is not None and not serve_metrics(telemetry.metrics.registry, port, settings.worker_metrics_host):
        port = None
    heartbeat = Heartbeat(
        settings, telemetry.activity, model=settings.served_model_name, device=device, metrics_port=port
    )
    heartbeat.start()

    def stop() -> None:
        heartbeat.stop()
        mark_process_dead(heartbeat.pid)

    return stop

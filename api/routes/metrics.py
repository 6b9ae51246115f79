"""``GET /metrics``: Prometheus text exposition of the service's state and of the API's traffic.

Each app has its own `CollectorRegistry` (`install_metrics`), holding:

| metric | type | labels | source |
|---|---|---|---|
| ``batchinfer_database_up`` | gauge | | 1 when the scrape's database queries answered |
| ``batchinfer_batches`` | gauge | ``status`` (every `BatchStatus`) | batches table, on scrape |
| ``batchinfer_batch_requests_total`` | counter | ``state`` (completed, failed) | batches' request_counts, on scrape |
| ``batchinfer_tokens_total`` | counter | ``kind`` (input, output, cached) | batches' usage, on scrape |
| ``batchinfer_files`` / ``batchinfer_file_bytes`` | gauge | ``purpose`` | files table, on scrape |
| ``batchinfer_schedules`` | gauge | | schedules table, on scrape |
| ``batchinfer_eval_latest_pass_rate`` | gauge | ``eval_id``, ``criterion``, ``model`` | latest completed eval runs, on scrape |
| ``batchinfer_http_requests_total`` | counter | ``method``, ``route`` (template, or "unmatched"), ``status_code`` | this process |

Database figures are read on every scrape by a custom collector (the prometheus_client pattern for
state owned elsewhere), so they are right whichever process changed them. HTTP counts are this
API process's own (not multiprocess-aggregated).

With ``Settings.engine_metrics_dir`` set (``batchinfer serve`` sets it), the scrape also carries the
engine metrics (``batchinfer:*``, labelled ``model_name``; `worker.metrics`) of every worker process
writing prometheus_client's multiprocess files into that folder: its workers are started with
``PROMETHEUS_MULTIPROC_DIR`` pointing there. No port to set, nothing to scrape but the API; the files
are read on each scrape, so a worker that is restarted shows again without the API knowing it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.db import get_engine
from jobs.models import Batch, EvalRun, File, Schedule
from jobs.status import BatchStatus

logger = logging.getLogger(__name__)
router = APIRouter(tags=["metrics"])
UNMATCHED_ROUTE = "unmatched"


class DatabaseCollector:
    """Collects the database-backed metrics of the module table on each scrape (read-only queries)."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("batchinfer_database_up", "1 when the metrics queries reached the database")
        try:
            families = self._families()
        except SQLAlchemyError:
            logger.exception("metrics: database queries failed")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self) -> list[Metric]:
        with get_engine(self.database_url, read_only=True).connect() as connection:
            by_status = dict(connection.execute(select(Batch.status, func.count()).group_by(Batch.status)).all())
            completed, failed, input_tokens, output_tokens, cached_tokens = tuple(
                connection.execute(
                    select(
                        *(
                            func.coalesce(func.sum(column), 0)
                            for column in (
                                Batch.completed_requests,
                                Batch.failed_requests,
                                Batch.input_tokens,
                                Batch.output_tokens,
                                Batch.cached_tokens,
                            )
                        )
                    )
                ).one()
            )
            files = connection.execute(
                select(File.purpose, func.count(), func.coalesce(func.sum(File.num_bytes), 0)).group_by(File.purpose)
            ).all()
            num_schedules = connection.scalar(select(func.count()).select_from(Schedule))
            runs = connection.execute(
                select(EvalRun.eval_id, EvalRun.model, EvalRun.per_testing_criteria_results)
                .where(EvalRun.status == "completed")
                .order_by(EvalRun.created_at.desc(), EvalRun.id.desc())
            ).all()

        batches = GaugeMetricFamily("batchinfer_batches", "Batches by status", labels=["status"])
        for status in BatchStatus:
            batches.add_metric([status.value], by_status.get(status.value, 0))
        requests = CounterMetricFamily(
            "batchinfer_batch_requests", "Batch input lines finished, by outcome", labels=["state"]
        )
        requests.add_metric(["completed"], completed)
        requests.add_metric(["failed"], failed)
        tokens = CounterMetricFamily("batchinfer_tokens", "Tokens used by finished lines", labels=["kind"])
        for kind, value in (("input", input_tokens), ("output", output_tokens), ("cached", cached_tokens)):
            tokens.add_metric([kind], value)
        num_files = GaugeMetricFamily("batchinfer_files", "Stored files by purpose", labels=["purpose"])
        file_bytes = GaugeMetricFamily("batchinfer_file_bytes", "Bytes of stored files by purpose", labels=["purpose"])
        for purpose, count, num_bytes in files:
            num_files.add_metric([purpose], count)
            file_bytes.add_metric([purpose], num_bytes)
        schedules = GaugeMetricFamily("batchinfer_schedules", "Scheduled evaluation runs")
        schedules.add_metric([], num_schedules or 0)
        latest = _latest_pass_rates([(row.eval_id, row.model, row.per_testing_criteria_results) for row in runs])
        return [batches, requests, tokens, num_files, file_bytes, schedules, latest]


def _latest_pass_rates(runs: Sequence[tuple[str, str, Any]]) -> Metric:
    """Each (eval, criterion, model)'s pass rate (0..1) in its latest completed run that graded it;
    ``runs`` are ``(eval_id, model, per_testing_criteria_results)``, newest first."""
    gauge = GaugeMetricFamily(
        "batchinfer_eval_latest_pass_rate",
        "Pass rate of each eval criterion in the latest completed run, per model",
        labels=["eval_id", "criterion", "model"],
    )
    seen: set[tuple[str, str, str]] = set()
    for eval_id, model, results in runs:
        for entry in results or []:
            key = (eval_id, entry["testing_criteria"], model)
            graded = entry["passed"] + entry["failed"]
            if key in seen or not graded:
                continue
            seen.add(key)
            gauge.add_metric(list(key), entry["passed"] / graded)
    return gauge


class RequestCountMiddleware:
    """ASGI middleware: counts every HTTP request by method, route template and response status.

    The route is read from ``scope["route"]`` after the app ran (Starlette's router sets it), so ids
    in paths never become label values. A request that raises counts as status 500.
    """

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_code = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.counter.labels(scope["method"], _route_label(scope), str(status_code)).inc()


def _route_label(scope: Scope) -> str:
    """The matched route's path template; under a mount (the UI's static files) ``{mount}/{path}``;
    else ``UNMATCHED_ROUTE``. Starlette's ``Mount`` sets no ``route`` but extends ``root_path`` by its prefix."""
    route = getattr(scope.get("route"), "path", None)
    if route:
        return str(route)
    root_path, app_root_path = str(scope.get("root_path", "")), str(scope.get("app_root_path", ""))
    if root_path and root_path.startswith(app_root_path) and root_path != app_root_path:
        return root_path[len(app_root_path) :] + "/{path}"
    return UNMATCHED_ROUTE


def install_metrics(app: FastAPI, database_url: str, engine_metrics_dir: Path | None = None) -> CollectorRegistry:
    """Give ``app`` its registry (``app.state.metrics_registry``), the request counter and ``GET /metrics``;
    with ``engine_metrics_dir`` (created when missing), the engine metrics of the worker processes writing
    multiprocess files there."""
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(database_url))
    if engine_metrics_dir is not None:
        engine_metrics_dir.mkdir(parents=True, exist_ok=True)
        MultiProcessCollector(registry, path=str(engine_metrics_dir))  # type: ignore[no-untyped-call]
    counter = Counter(
        "batchinfer_http_requests",
        "HTTP requests served by this API process",
        ["method", "route", "status_code"],
        registry=registry,
    )
    app.state.metrics_registry = registry
    app.add_middleware(RequestCountMiddleware, counter=counter)
    app.include_router(router)
    return registry


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(content=generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)

"""The FastAPI app: OpenAI Files, Batches and Models endpoints, ``POST /v1/jobs``, ``/v1/schedules``,
``GET /v1/workers``, ``GET /health``, ``GET /metrics`` and the read-only jobs page at ``/ui``.

Serve with ``uvicorn --factory api.main:create_app`` (or ``batchinfer serve``, which also runs the
migrations first). The app never imports torch or worker code: it validates and enqueues; workers run.

Every ``/v1`` route and ``/ui`` page needs an API key once the deployment has one (`api.auth`);
``/health``, ``/metrics`` and the static files stay open. A request body is received before the
request enters the app, within size, time and concurrency limits; keys are also held to a request
rate and an enqueued-token limit (docs/api.md, "Limits").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from api.admission import Admission, admission_slots
from api.errors import install_error_handlers
from api.limits import RequestBodies
from api.rate_limits import RequestRate, check_request_rate
from api.routes import batches, evals, files, health, jobs, models, schedules, ui_evals, workers
from api.routes.metrics import install_metrics
from api.routes.ui import install_ui
from jobs.api_keys import keys_required
from jobs.config import Settings, get_settings
from jobs.db import session_scope
from jobs.intake import resume_validating_batches
from jobs.status import now_s

logger = logging.getLogger(__name__)


def _log_access_mode(settings: Settings) -> None:
    try:
        with session_scope(settings.database_url, read_only=True) as session:
            required = keys_required(session)
    except Exception as exc:
        logger.warning("could not tell whether API keys exist: %s", exc)
        return
    if required:
        logger.info("API keys are required: each key sees only the files, batches and schedules it created")
    else:
        logger.warning(
            "no API key exists, so the API is open to anyone who can reach it "
            "(create one with 'batchinfer keys create' to require keys)"
        )


def _start_up(settings: Settings, started_at: int) -> None:
    _log_access_mode(settings)
    try:
        resume_validating_batches(settings=settings, started_at=started_at)
    except Exception as exc:
        logger.warning("could not look for batches left validating: %s", exc)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """On start-up, in a background thread: say whether keys are required, then validate the batches an
    earlier process left ``validating``."""
    threading.Thread(
        target=_start_up,
        kwargs={"settings": app.state.settings, "started_at": now_s()},
        name="api-start-up",
        daemon=True,
    ).start()
    yield


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app for ``settings`` (default `get_settings()`); the database must be migrated.

    Start-up resumes batches an earlier process left ``validating`` (`jobs.intake.resume_validating_batches`).
    """
    settings = settings or get_settings()
    app = FastAPI(
        title="batchinfer",
        version="0.1.0",
        summary="OpenAI Batch API over our own inference engine",
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.request_rate = RequestRate(settings.max_requests_per_minute)
    install_error_handlers(app)
    for module in (files, batches, jobs, schedules, evals, workers, models):
        app.include_router(module.router, dependencies=[Depends(check_request_rate)])
    app.include_router(health.router)
    install_ui(app, dependencies=[Depends(check_request_rate)])
    app.include_router(ui_evals.router, dependencies=[Depends(check_request_rate)])
    slots = admission_slots()
    app.add_middleware(Admission, slots=slots)
    # NOTE: a middleware added later runs outside the earlier ones: a body is received (or refused) before
    # its request takes an admission slot, and the request counter of the metrics sees those refusals too.
    app.add_middleware(RequestBodies, settings=settings, admission_slots=slots)
    install_metrics(app, settings.database_url, settings.engine_metrics_dir)
    return app

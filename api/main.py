"""The FastAPI app: OpenAI Files, Batches and Models endpoints, ``POST /v1/jobs``, ``/v1/schedules``,
``GET /v1/workers``, ``GET /health``, ``GET /metrics`` and the read-only jobs page at ``/ui``.

Serve with ``uvicorn --factory api.main:create_app`` (or ``batchinfer serve``, which also runs the
migrations first). The app never imports torch or worker code: it validates and enqueues; workers run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.routes import batches, files, health, jobs, models, schedules, workers
from api.routes.metrics import install_metrics
from api.routes.ui import install_ui
from jobs.config import Settings, get_settings
from jobs.intake import resume_validating_batches
from jobs.status import now_s

logger = logging.getLogger(__name__)


def _resume_validating(settings: Settings, started_at: int) -> None:
    try:
        resume_validating_batches(settings=settings, started_at=started_at)
    except Exception as exc:
        logger.warning("could not look for batches left validating: %s", exc)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """On start-up, validate in a background thread the batches an earlier process left ``validating``."""
    threading.Thread(
        target=_resume_validating,
        kwargs={"settings": app.state.settings, "started_at": now_s()},
        name="resume-validating",
        daemon=True,
    ).start()
    yield


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app for ``settings`` (default `get_settings()`); the database must be migrated.

    Start-up resumes batches an earlier process left ``validating`` (`jobs.intake.resume_validating_batches`).
    """
    app = FastAPI(
        title="batchinfer",
        version="0.1.0",
        summary="OpenAI Batch API over our own inference engine",
        lifespan=_lifespan,
    )
    app.state.settings = settings or get_settings()
    install_error_handlers(app)
    for module in (files, batches, jobs, schedules, workers, models, health):
        app.include_router(module.router)
    install_metrics(app, app.state.settings.database_url)
    install_ui(app)
    return app

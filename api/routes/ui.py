"""``/ui``: the read-only jobs page, rendered on the server (Jinja2 templates in ``api/templates``).

Pages (docs/api.md, "Jobs page"):
- ``/ui``: batches (status, progress bar, tokens, tokens/s, created and finished times), schedules
  (next and last runs) and live workers (ready or starting); while a batch waits for lines to run and
  no live worker of its model is ready, a note says so ("waiting: no worker serves model M", or "no
  worker is ready (1 starting)");
- ``/ui/batches/{id}``: request counts, the same note while it applies, a plot of finished lines and output tokens over time (inline
  SVG from the lines' ``finished_at``), the first failed lines, links to the output and error files;
- ``/ui/files/{id}``: the first lines of a stored file, with a link to its raw content.

A page showing a running batch carries ``data-refresh``; ``/ui/static/ui.js`` then re-fetches it
every few seconds and swaps its ``<main>`` in place. No build step, no client framework.

Each page shows only what the request's API key owns (`api.auth`; a browser sends the key as the
HTTP Basic password); workers are shown to every key, the batch a worker runs only to its owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SettingsDep
from jobs.errors import NotFound
from jobs.files import file_chunks, get_file
from jobs.progress import FinishPoint, batch_progress, finish_series, first_failed_lines
from jobs.repository import get_batch, list_batches
from jobs.schedules import list_schedules
from jobs.status import now_s
from jobs.storage import storage_from_settings
from jobs.validation import numbered_lines
from jobs.workers import WorkerReadiness, live_worker_objects, worker_readiness

HERE = Path(__file__).resolve().parent.parent
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(prefix="/ui", include_in_schema=False)
MAX_BATCHES = 50
MAX_FILE_LINES = 200
REFRESH_MS = 2000


def _time(value: int | None) -> str:
    return "" if value is None else datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")


templates.env.filters["utc"] = _time


@dataclass(frozen=True, slots=True)
class Plot:
    """Two cumulative series on one time axis, as SVG polyline points in a ``width`` x ``height`` box."""

    width: int
    height: int
    lines_points: str
    tokens_points: str
    max_lines: int
    max_tokens: int
    span_s: int


def _plot(series: list[FinishPoint], start_s: int | None, width: int = 600, height: int = 200) -> Plot | None:
    if not series:
        return None
    t0 = min(start_s or series[0].finished_at, series[0].finished_at)
    span_s = max(1, series[-1].finished_at - t0)
    max_lines = series[-1].num_lines
    max_tokens = max(1, series[-1].num_output_tokens)

    def points(values: list[tuple[int, int]], top: int) -> str:
        coords = [(0.0, float(height))] + [
            (width * (t - t0) / span_s, height - height * v / max(1, top)) for t, v in values
        ]
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)

    return Plot(
        width=width,
        height=height,
        lines_points=points([(p.finished_at, p.num_lines) for p in series], max_lines),
        tokens_points=points([(p.finished_at, p.num_output_tokens) for p in series], max_tokens),
        max_lines=max_lines,
        max_tokens=max_tokens,
        span_s=span_s,
    )


@router.get("", response_class=HTMLResponse)
def index(request: Request, session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep) -> HTMLResponse:
    now = now_s()
    batches, _ = list_batches(session, limit=MAX_BATCHES, owner=owner)
    progress = [batch_progress(batch, now=now) for batch in batches]
    schedules, _ = list_schedules(session, limit=MAX_BATCHES, owner=owner)
    live = live_worker_objects(session, now=now, live_s=settings.worker_live_s, owner=owner)
    waiting_models = sorted(
        {batch.model or "" for batch, p in zip(batches, progress, strict=True) if p.waits_for_workers}
    )
    notes = [WorkerReadiness.of(live, model=model or None).waiting_note() for model in waiting_models]
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "batches": progress,
            "schedules": schedules,
            "workers": live,
            "waiting_note": "; ".join(note for note in notes if note) or None,
            "refresh_ms": REFRESH_MS if any(not p.is_terminal for p in progress) else None,
        },
    )


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
def batch_page(
    request: Request, session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep, batch_id: str
) -> HTMLResponse:
    batch = get_batch(session, batch_id=batch_id, owner=owner)
    now = now_s()
    progress = batch_progress(batch, now=now)
    waiting_note = None
    if progress.waits_for_workers:
        readiness = worker_readiness(session, now=now, live_s=settings.worker_live_s, model=batch.model)
        waiting_note = readiness.waiting_note()
    return templates.TemplateResponse(
        request,
        "batch.html",
        {
            "p": progress,
            "waiting_note": waiting_note,
            "plot": _plot(finish_series(session, batch_id=batch_id), batch.started_at or batch.in_progress_at),
            "failed": first_failed_lines(session, batch_id=batch_id),
            "refresh_ms": None if progress.is_terminal else REFRESH_MS,
        },
    )


@router.get("/files/{file_id}", response_class=HTMLResponse)
def file_page(
    request: Request, session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep, file_id: str
) -> HTMLResponse:
    file = get_file(session, file_id=file_id, owner=owner)
    if file is None:
        raise NotFound("file", file_id)
    chunks = file_chunks(file, storage=storage_from_settings(settings), session=session)
    first = islice(numbered_lines(chunks), MAX_FILE_LINES + 1)
    lines = [raw.rstrip(b"\r").decode("utf-8", errors="replace") for _, raw in first]
    return templates.TemplateResponse(
        request,
        "file.html",
        {"file": file, "lines": lines[:MAX_FILE_LINES], "truncated": len(lines) > MAX_FILE_LINES, "refresh_ms": None},
    )


def install_ui(app: FastAPI, *, dependencies: Sequence[Any] = ()) -> None:
    """Mount the pages (behind ``dependencies``, e.g. the API key check) and their static files
    (``/ui/static``, open) on ``app``."""
    app.include_router(router, dependencies=list(dependencies))
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")

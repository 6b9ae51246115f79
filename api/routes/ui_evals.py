"""``/ui/evals``: the evals pages, rendered on the server with the jobs pages' templates (`api.routes.ui`).

- ``/ui/evals``: each eval, with a trend plot of each criterion's pass rate over its runs (inline SVG, one
  line per criterion and model, one point per run that graded something);
- ``/ui/evals/{eval_id}/runs/{run_id}``: the run's counts, each criterion's results, and its failing items
  with the item (where its expected answer is) beside the model's output and each criterion's verdict.

Each page shows only what the request's API key owns (`api.auth`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from api.auth import OwnerDep
from api.deps import ReadSessionDep
from api.routes.ui import templates
from jobs.evals.repository import criterion_pass_rates, get_eval, get_run, list_evals, list_output_items, list_runs
from jobs.models import Eval, EvalOutputItem, EvalRun

router = APIRouter(prefix="/ui/evals", include_in_schema=False)
MAX_EVALS = 50
MAX_RUNS = 100
MAX_FAILING_ITEMS = 50
WIDTH, HEIGHT = 480, 160


@dataclass(frozen=True, slots=True)
class TrendLine:
    """One criterion's pass rate on one model over runs: SVG ``points`` and ``(x, y, label)`` dots."""

    criterion: str
    model: str
    points: str
    dots: list[tuple[float, float, str]]
    color: str


@dataclass(frozen=True, slots=True)
class EvalTrend:
    """An eval's row on the evals page: its runs (oldest first) and trend lines."""

    eval: Eval
    runs: list[EvalRun]
    lines: list[TrendLine]
    width: int = WIDTH
    height: int = HEIGHT


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def trend_lines(runs: list[EvalRun], width: int = WIDTH, height: int = HEIGHT) -> list[TrendLine]:
    """Each (criterion, model)'s pass rate per run, x by run order (oldest left), y 0..1 bottom to top.

    A run that graded nothing for the criterion (queued, failed) leaves no point.
    """
    step = width / max(1, len(runs) - 1)
    series: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for index, run in enumerate(runs):
        for criterion, rate in criterion_pass_rates(run).items():
            if rate is None:
                continue
            x = step * index if len(runs) > 1 else width / 2
            series.setdefault((criterion, run.model), []).append((x, height - height * rate, f"{rate:.0%} {run.id}"))
    return [
        TrendLine(criterion, model, " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in dots), dots, COLORS[i % len(COLORS)])
        for i, ((criterion, model), dots) in enumerate(sorted(series.items()))
    ]


def _trend(session: Session, row: Eval, owner: str | None) -> EvalTrend:
    runs, _ = list_runs(session, eval_id=row.id, limit=MAX_RUNS, order="desc", owner=owner)
    runs.reverse()
    return EvalTrend(row, runs, trend_lines(runs))


@router.get("", response_class=HTMLResponse)
def evals_page(request: Request, session: ReadSessionDep, owner: OwnerDep) -> HTMLResponse:
    rows, _ = list_evals(session, limit=MAX_EVALS, order="desc", owner=owner)
    trends = [_trend(session, row, owner) for row in rows]
    return templates.TemplateResponse(request, "evals.html", {"trends": trends, "refresh_ms": None})


@router.get("/{eval_id}/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, session: ReadSessionDep, owner: OwnerDep, eval_id: str, run_id: str) -> HTMLResponse:
    row = get_eval(session, eval_id=eval_id, owner=owner)
    run = get_run(session, eval_id=eval_id, run_id=run_id, owner=owner)
    failing = [
        item
        for status in ("fail", "error")
        for item in list_output_items(
            session, eval_id=eval_id, run_id=run_id, limit=MAX_FAILING_ITEMS, status=status, owner=owner
        )[0]
    ]
    rates = criterion_pass_rates(run)
    return templates.TemplateResponse(
        request,
        "eval_run.html",
        {
            "eval": row,
            "run": run,
            "criteria": [(entry, rates.get(entry["testing_criteria"])) for entry in run.per_testing_criteria_results],
            "failing": [(item, _pretty(item.datasource_item), _output(item)) for item in failing],
            "refresh_ms": None if run.status in ("completed", "failed", "canceled") else 2000,
        },
    )


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _output(item: EvalOutputItem) -> str:
    """The model's answer as the run page shows it: each output message's content (a given sample: its
    ``output_text``), the item's error when it never reached the model, else the sample."""
    sample = item.sample
    if sample is None and item.error is not None:
        return f"error ({item.error.get('code')}): {item.error.get('message')}"
    if sample and isinstance(sample.get("output_text"), str):
        return str(sample["output_text"])
    outputs = (sample or {}).get("output") or []
    texts = [str(message.get("content") or "") for message in outputs if isinstance(message, dict)]
    return "\n---\n".join(texts) if texts else _pretty(sample)

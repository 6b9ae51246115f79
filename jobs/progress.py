"""How far a batch has come: counts, rates and the line-by-line finish series (docs/api.md, "Jobs page").

Read-only views over ``batches`` and ``batch_requests`` for the jobs page (``/ui``). Times are Unix
seconds; a line's ``finished_at`` is when its result was recorded, so rates have a one-second grain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, RequestState
from jobs.status import BatchStatus
from jobs.storable_text import escaped
from jobs.workers import waits_for_workers


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """One batch's progress as the jobs page shows it.

    ``tokens_per_s`` is output tokens over the seconds since a worker claimed the batch (until its
    terminal time, or ``now``); 0 before the claim. ``finished_at`` is the terminal timestamp, if any.
    """

    batch: Batch
    status: BatchStatus
    total: int
    completed: int
    failed: int
    output_tokens: int
    tokens_per_s: float
    finished_at: int | None

    @property
    def num_done(self) -> int:
        return self.completed + self.failed

    @property
    def fraction_done(self) -> float:
        """Lines with a result / all lines, in [0, 1] (0 while the total is unknown)."""
        return self.num_done / self.total if self.total else 0.0

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def waits_for_workers(self) -> bool:
        """Lines still need a worker (`jobs.workers.waits_for_workers`)."""
        return waits_for_workers(self.status.value, num_done=self.num_done, total=self.total)


def batch_progress(batch: Batch, *, now: int) -> BatchProgress:
    """The progress of ``batch`` as of ``now`` (Unix seconds)."""
    status = BatchStatus(batch.status)
    finished_at = {
        BatchStatus.COMPLETED: batch.completed_at,
        BatchStatus.FAILED: batch.failed_at,
        BatchStatus.EXPIRED: batch.expired_at,
        BatchStatus.CANCELLED: batch.cancelled_at,
    }.get(status)
    started_at = batch.started_at or batch.in_progress_at
    tokens_per_s = 0.0
    if started_at is not None:
        elapsed_s = max(1, (finished_at or now) - started_at)
        tokens_per_s = batch.output_tokens / elapsed_s
    return BatchProgress(
        batch=batch,
        status=status,
        total=batch.total_requests,
        completed=batch.completed_requests,
        failed=batch.failed_requests,
        output_tokens=batch.output_tokens,
        tokens_per_s=tokens_per_s,
        finished_at=finished_at,
    )


@dataclass(frozen=True, slots=True)
class FinishPoint:
    """After the lines finished by ``finished_at``: how many had finished and their output tokens."""

    finished_at: int
    num_lines: int
    num_output_tokens: int


def finish_series(session: Session, *, batch_id: str) -> list[FinishPoint]:
    """Cumulative finished lines and output tokens per second that saw a line finish, in time order."""
    rows = session.execute(
        select(BatchRequest.finished_at, BatchRequest.completion_tokens)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.finished_at.is_not(None))
        .order_by(BatchRequest.finished_at)
    ).all()
    series: list[FinishPoint] = []
    num_tokens = 0
    for num_lines, (finished_at, completion_tokens) in enumerate(rows, start=1):
        assert finished_at is not None  # filtered in the query
        num_tokens += completion_tokens
        if series and series[-1].finished_at == finished_at:
            series[-1] = FinishPoint(finished_at, num_lines, num_tokens)
        else:
            series.append(FinishPoint(finished_at, num_lines, num_tokens))
    return series


@dataclass(frozen=True, slots=True)
class FailedLine:
    line_number: int
    custom_id: str
    status_code: int | None
    message: str


def first_failed_lines(session: Session, *, batch_id: str, limit: int = 10) -> list[FailedLine]:
    """The batch's first ``limit`` failed lines by line number, with the error message each got."""
    rows = session.scalars(
        select(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.FAILED.value)
        .order_by(BatchRequest.line_number)
        .limit(limit)
    )
    return [
        FailedLine(
            row.line_number,
            row.custom_id if row.custom_id is not None else escaped(row.custom_id_sent or ""),
            (row.response or {}).get("status_code"),
            _error_message(row),
        )
        for row in rows
    ]


def _error_message(row: BatchRequest) -> str:
    if row.error:
        return str(row.error.get("message", row.error))
    body: dict[str, Any] = (row.response or {}).get("body") or {}
    error = body.get("error")
    return str(error.get("message", error)) if isinstance(error, dict) else "no message"

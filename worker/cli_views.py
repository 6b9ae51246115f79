"""How ``batchinfer submit --wait``, ``status`` and ``ls`` show batches in the terminal (docs/api.md, "Command line").

On a terminal (stderr for the progress bar, stdout for tables) `rich` draws a live bar and tables;
otherwise the same facts go out as plain lines, one per change, so logs and pipes stay readable.
Everything here reads OpenAI batch objects (dicts) as the HTTP API returns them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

from jobs.workers import WorkerReadiness, waits_for_workers

MAX_ERRORS_SHOWN = 5  # file errors the summary of a failed batch lists


@dataclass(slots=True)
class Rates:
    """Lines and output tokens per second since the first poll that saw the batch ``in_progress`` with a line
    finished (the lines finished by then do not count); ETA in s."""

    lines_per_s: float
    tokens_per_s: float
    eta_s: float | None


def counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """``(completed, failed, total)`` of a batch object (zeros while unknown)."""
    request_counts = batch.get("request_counts") or {}
    return (request_counts.get("completed") or 0, request_counts.get("failed") or 0, request_counts.get("total") or 0)


def output_tokens(batch: dict[str, Any]) -> int:
    return int((batch.get("usage") or {}).get("output_tokens") or 0)


def _time(value: int | None) -> str:
    return "-" if value is None else datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class ProgressView:
    """Shows a waiting batch: a rich bar on a terminal, else a plain line whenever the counts change.

    Use as a context manager; call `update` with each polled batch object, `summary` at the end.
    """

    stream: IO[str]
    clock: Any = time.monotonic
    show_tokens: bool = True
    """False: the rates leave out tok/s (an eval run: its items count once graded, after generation)."""
    _console: Console = field(init=False)
    _progress: Progress | None = field(init=False, default=None)
    _task: TaskID | None = field(init=False, default=None)
    _started_s: float | None = field(init=False, default=None)
    _start_done: int = field(init=False, default=0)
    _start_tokens: int = field(init=False, default=0)
    _last_line: tuple[Any, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._console = Console(file=self.stream)

    @property
    def is_terminal(self) -> bool:
        return self._console.is_terminal

    def __enter__(self) -> ProgressView:
        if self.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.fields[status]:<11}"),
                BarColumn(),
                TextColumn("{task.fields[counts]}"),
                TextColumn("{task.fields[rates]}"),
                TextColumn("ETA {task.fields[eta]}"),
                console=self._console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("batch", total=None, status="", counts="", rates="", eta="-")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def rates(self, batch: dict[str, Any]) -> Rates:
        completed, failed, total = counts(batch)
        done, tokens = completed + failed, output_tokens(batch)
        if self._started_s is None:
            # NOTE: the clock starts at the first finished line, not at in_progress: a worker may take a
            # while to start (loading the model), and counting that time made the first ETA hours long.
            if batch.get("status") != "in_progress" or (done == 0 and tokens == 0):
                return Rates(0.0, 0.0, None)
            self._started_s, self._start_done, self._start_tokens = self.clock(), done, tokens
        elapsed_s = max(self.clock() - self._started_s, 1e-9)
        lines_per_s = (done - self._start_done) / elapsed_s
        tokens_per_s = (tokens - self._start_tokens) / elapsed_s
        eta_s = (total - done) / lines_per_s if lines_per_s > 0 else None
        return Rates(lines_per_s, tokens_per_s, eta_s)

    def update(self, batch: dict[str, Any]) -> None:
        completed, failed, total = counts(batch)
        rates = self.rates(batch)
        status = batch["status"]
        count_text = f"{completed}/{failed}/{total} (completed/failed/total)"
        rate_text = f"{rates.lines_per_s:.2f} lines/s" + (
            f" {rates.tokens_per_s:.1f} tok/s" if self.show_tokens else ""
        )
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=completed + failed,
                total=total or None,
                status=status,
                counts=count_text,
                rates=rate_text,
                eta=_duration(rates.eta_s),
            )
            return
        line = (status, completed, failed, total)
        if line != self._last_line:
            self._last_line = line
            print(
                f"batch {batch['id']}: {status} {count_text}, {rate_text}, ETA {_duration(rates.eta_s)}",
                file=self.stream,
                flush=True,
            )

    def summary(self, batch: dict[str, Any]) -> str:
        """One line for the end: status, counts, wall time and rates of the run; then, for a batch that failed
        validation, its first ``MAX_ERRORS_SHOWN`` file errors (line, code, message), one per line."""
        completed, failed, total = counts(batch)
        started, ended = batch.get("in_progress_at"), _ended_at(batch)
        elapsed = (ended - started) if started is not None and ended is not None else None
        text = f"batch {batch['id']}: {batch['status']}, {completed} completed, {failed} failed of {total}"
        if elapsed:
            text += (
                f" in {_duration(elapsed)} ({(completed + failed) / elapsed:.2f} lines/s, "
                f"{output_tokens(batch) / elapsed:.1f} output tok/s)"
            )
        errors = (batch.get("errors") or {}).get("data") or []
        num_errors = (batch.get("errors") or {}).get("total") or len(errors)  # data keeps the first 1,000
        for error in errors[:MAX_ERRORS_SHOWN]:  # a batch that failed validation: why, line by line
            where = "" if error.get("line") is None else f"line {error['line']}: "
            text += f"\n  {where}{error.get('code')}: {error.get('message')}"
        if num_errors > MAX_ERRORS_SHOWN:
            text += f"\n  ... and {num_errors - MAX_ERRORS_SHOWN} more (the batch's errors)"
        print(text, file=self.stream, flush=True)
        return text


def _ended_at(batch: dict[str, Any]) -> int | None:
    for key in ("completed_at", "failed_at", "expired_at", "cancelled_at"):
        if batch.get(key) is not None:
            value: int = batch[key]
            return value
    return None


def workers_row(batch: dict[str, Any], workers: list[dict[str, Any]] | None) -> str | None:
    """What ``batchinfer status`` says about the workers for a batch that still has lines to run
    (``validating``, or ``in_progress`` with lines left): ``"2 ready"`` (workers of the batch's model), or
    the note of `jobs.workers.WorkerReadiness.waiting_note` (``"waiting: no worker serves model M"``,
    ``"waiting: no worker is ready (1 starting)"``) when no live worker of its model is ready.
    None for any other batch, or when the workers are unknown (``workers`` None:
    ``GET /v1/workers`` did not answer)."""
    completed, failed, total = counts(batch)
    if workers is None or not waits_for_workers(batch.get("status", ""), num_done=completed + failed, total=total):
        return None
    model = batch.get("model") or None
    serving = [worker for worker in workers if model is None or worker.get("model") == model]
    num_ready = sum(worker.get("ready_s") is not None for worker in serving)
    readiness = WorkerReadiness(num_ready=num_ready, num_starting=len(serving) - num_ready, model=model)
    note = readiness.waiting_note()
    if note is not None:
        return note
    return f"{num_ready} ready" + (f", {readiness.num_starting} starting" if readiness.num_starting else "")


def print_status(batch: dict[str, Any], stream: IO[str], workers: list[dict[str, Any]] | None = None) -> None:
    """``batchinfer status``: one batch's facts, as a table on a terminal or ``key: value`` lines; with the
    live ``workers`` (``GET /v1/workers``'s data), a ``workers`` row for a batch waiting on them (`workers_row`)."""
    completed, failed, total = counts(batch)
    usage = batch.get("usage") or {}
    rows = [
        ("id", batch["id"]),
        ("status", batch["status"]),
        ("endpoint", batch.get("endpoint") or "-"),
        ("requests", f"{completed} completed, {failed} failed, {total} total"),
        ("tokens", f"input {usage.get('input_tokens', 0)}, output {usage.get('output_tokens', 0)}"),
        ("created", _time(batch.get("created_at"))),
        ("started", _time(batch.get("in_progress_at"))),
        ("ended", _time(_ended_at(batch))),
        ("output file", batch.get("output_file_id") or "-"),
        ("error file", batch.get("error_file_id") or "-"),
    ]
    workers_text = workers_row(batch, workers)
    if workers_text is not None:
        rows.insert(3, ("workers", workers_text))
    console = Console(file=stream)
    if console.is_terminal:
        table = Table(show_header=False, box=None)
        for key, value in rows:
            table.add_row(f"[bold]{key}", str(value))
        console.print(table)
        return
    for key, value in rows:
        print(f"{key}: {value}", file=stream)


def print_batches(batches: list[dict[str, Any]], stream: IO[str]) -> None:
    """``batchinfer ls``: newest first, one row per batch (a rich table on a terminal, else tab-separated)."""
    header = ("id", "status", "completed", "failed", "total", "output_tokens", "created")
    rows = [
        (b["id"], b["status"], *map(str, counts(b)), str(output_tokens(b)), _time(b.get("created_at"))) for b in batches
    ]
    console = Console(file=stream)
    if console.is_terminal:
        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    for row in (header, *rows):
        print("\t".join(row), file=stream)

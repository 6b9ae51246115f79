"""Run one batch: every pending line through the engine as one stream, each result persisted as it lands.

Flow (plain functions; the Celery task in `worker.tasks` only calls `run_batch`):
1. Load the batch's pending lines (a re-delivered task resumes where the last run stopped).
2. Parse each line body with its endpoint's schema and map it to prompt token ids + `SamplingParams`
   (`worker.request_mapping`). A line the endpoint rejects (a bad field, a token id outside the
   vocabulary, a prompt longer than the context) gets a 400 ``response`` with an OpenAI error body
   and counts as failed; its neighbours run.
3. Order the lines by prompt token ids, so lines sharing a prefix are admitted together and hit the
   prefix cache (docs/engine.md, "Prefix caching"), and add them ALL to the engine; then step until
   done. Continuous batching keeps the running batch full; no line waits for another to finish.
4. Record each finished line in the database as it finishes, committing in small groups so
   ``request_counts`` move while the batch runs.
5. Every few steps, look at the batch row: ``cancelling`` aborts what is still running and finalizes as
   ``cancelled``; ``expires_at`` passed aborts and finalizes as ``expired``. Finished lines are kept.
6. `jobs.repository.finalize_batch` writes the output and error files and stamps the terminal status.

After every engine step the runner hands the engine's statistics (`LLMEngine.make_stats`, take and
reset) and the requests that finished to a `StepObserver`: by default this process's
`worker.telemetry.WorkerTelemetry`, which feeds the Prometheus metrics and the heartbeat
(docs/architecture.md, "Observability").

A failure confined to one line (its mapping, its response body) fails that line only. An exception
out of ``engine.step()`` cannot be pinned on one line: the lines in flight get a 500 ``server_error``
response and the batch still finalizes, with everything finished before kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobs import repository
from jobs.config import get_settings
from jobs.db import session_scope
from jobs.errors import InvalidRequest, NotFound, error_envelope
from jobs.schemas import CHAT_COMPLETIONS
from jobs.status import BatchStatus
from worker.engine.errors import InvalidParameterError, PromptTooLongError
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.stats import EngineStats
from worker.prefix_grouping import order_by_shared_prefix
from worker.request_mapping import MappedRequest, map_request
from worker.responses import build_body, context_length_message, new_request_id

logger = logging.getLogger(__name__)

COMMIT_EVERY = 16
CHECK_EVERY_STEPS = 8
# NOTE: a CPU step over a large batch can take seconds; cancel must not wait for 8 of them.
CHECK_INTERVAL_S = 1.0


class Engine(Protocol):
    """The slice of `worker.engine.llm_engine.LLMEngine` the runner drives."""

    tokenizer: Any

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def make_stats(self) -> EngineStats: ...


class StepObserver(Protocol):
    """Told what the engine does while a batch runs (`worker.telemetry.WorkerTelemetry` in a worker)."""

    def batch_started(self, batch_id: str) -> None: ...

    def step_done(self, stats: EngineStats, finished: list[RequestOutput]) -> None:
        """After each step: the engine's statistics since the last step and the requests it finished."""

    def batch_ended(self) -> None: ...


@dataclass(slots=True)
class LineResult:
    """What `jobs.repository.record_result` stores for one line."""

    request_id: str
    response: dict[str, Any] | None
    error: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class _ResultSink:
    """Buffers line results and commits them in groups of ``commit_every``."""

    database_url: str | None
    commit_every: int
    buffer: list[LineResult] = field(default_factory=list)
    num_recorded: int = 0

    def add(self, result: LineResult) -> None:
        self.buffer.append(result)
        if len(self.buffer) >= self.commit_every:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        with session_scope(self.database_url) as session:
            for result in self.buffer:
                try:
                    repository.record_result(
                        session,
                        request_id=result.request_id,
                        response=result.response,
                        error=result.error,
                        prompt_tokens=result.prompt_tokens,
                        completion_tokens=result.completion_tokens,
                        cached_tokens=result.cached_tokens,
                    )
                except repository.RequestAlreadyRecorded:
                    # NOTE: a duplicate delivery of the task ran this line too; the first result stands.
                    logger.warning("line %s already has a result; keeping the first", result.request_id)
        self.num_recorded += len(self.buffer)
        self.buffer.clear()


def run_batch(
    batch_id: str,
    *,
    engine: Engine | None = None,
    model_name: str | None = None,
    database_url: str | None = None,
    commit_every: int = COMMIT_EVERY,
    check_every_steps: int = CHECK_EVERY_STEPS,
    clock: Callable[[], float] = time.time,
    observer: StepObserver | None = None,
) -> BatchStatus | None:
    """Run every pending line of ``batch_id`` through ``engine`` and finalize the batch.

    Args:
        batch_id: the batch to run: ``in_progress`` runs; ``cancelling`` (or an interrupted
            ``finalizing``) only finalizes; any other status is left alone.
        engine: the engine to use; default this process's engine (`worker.bootstrap.get_engine`).
        model_name: the model name written in response bodies; default ``settings.served_model_name``.
        database_url: default ``settings.database_url``.
        commit_every: results per commit while the batch runs.
        check_every_steps: engine steps between looks at the batch row (cancel, expiry); it is also
            looked at whenever ``CHECK_INTERVAL_S`` seconds have passed since the last look.
        clock: unix seconds (tests move time to expire a batch).
        observer: told about every engine step; default this process's `worker.telemetry.get_telemetry`.

    Returns:
        The batch's status when the run ends, or None when the batch does not exist. A re-delivered
        task runs only the lines still pending, and is a no-op on a terminal batch.
    """
    now = int(clock())
    with session_scope(database_url) as session:
        try:
            batch = repository.get_batch(session, batch_id=batch_id)
        except NotFound:
            logger.warning("batch %s does not exist; nothing to run", batch_id)
            return None
        claimed = repository.claim_batch(session, batch_id=batch_id, now=now)
        endpoint, expires_at = batch.endpoint, batch.expires_at
        pending = [(r.id, r.body) for r in repository.pending_requests(session, batch_id=batch_id)] if claimed else []

    if not claimed:
        status = _current_status(batch_id, database_url)
        if status in (BatchStatus.CANCELLING, BatchStatus.FINALIZING):
            return _finalize(batch_id, database_url, now=now)
        return status
    if not pending or now >= expires_at:
        return _finalize(batch_id, database_url, now=now)

    if engine is None:
        from worker.bootstrap import get_engine

        engine = get_engine()
    model_name = model_name or get_settings().served_model_name
    if observer is None:
        from worker.telemetry import get_telemetry

        observer = get_telemetry(model_name, getattr(engine, "max_model_len", 8192))
    sink = _ResultSink(database_url, commit_every)
    observer.batch_started(batch_id)
    try:
        outcome = _stream(
            engine,
            endpoint,
            pending,
            sink,
            model_name=model_name,
            batch_id=batch_id,
            database_url=database_url,
            expires_at=expires_at,
            check_every_steps=check_every_steps,
            clock=clock,
            observer=observer,
        )
    finally:
        observer.batch_ended()
    sink.flush()
    logger.info("batch %s: %d lines recorded, ending as %s", batch_id, sink.num_recorded, outcome or "finished")
    return _finalize(batch_id, database_url, now=int(clock()))


def _stream(
    engine: Engine,
    endpoint: str,
    pending: list[tuple[str, dict[str, Any]]],
    sink: _ResultSink,
    *,
    model_name: str,
    batch_id: str,
    database_url: str | None,
    expires_at: int,
    check_every_steps: int,
    clock: Callable[[], float],
    observer: StepObserver,
) -> str | None:
    """Feed all lines, step until done; returns ``"cancelled"``/``"expired"`` when stopped early."""
    mapped = _map_lines(engine, endpoint, pending, sink)
    in_flight: dict[str, MappedRequest] = {}
    try:
        items = list(mapped.items())
        admission_order = order_by_shared_prefix([request.prompt_token_ids for _, request in items])
        for request_id, request in (items[index] for index in admission_order):
            try:
                engine.add_request(request_id, request.prompt_token_ids, request.params)
            except PromptTooLongError as exc:
                sink.add(_context_length_result(request_id, endpoint, exc))
                continue
            except InvalidParameterError as exc:
                sink.add(_rejected(request_id, str(exc), param=exc.param, code="invalid_value"))
                continue
            except ValueError as exc:
                sink.add(_rejected(request_id, str(exc), param=None))
                continue
            in_flight[request_id] = request

        num_steps, last_check_s = 0, time.monotonic()
        while in_flight:
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("batch %s: engine step failed; failing %d lines in flight", batch_id, len(in_flight))
                for request_id in list(in_flight):
                    sink.add(_server_error(request_id, f"the engine failed while running this request: {exc}"))
                _abort(engine, in_flight)
                return None
            observer.step_done(engine.make_stats(), outputs)
            for output in outputs:
                if not output.finished or output.request_id not in in_flight:
                    continue
                request = in_flight.pop(output.request_id)
                sink.add(_completed(output, request, model_name=model_name, tokenizer=engine.tokenizer))
            if in_flight and not engine.has_unfinished_requests():
                logger.error("batch %s: the engine dropped %d lines without output", batch_id, len(in_flight))
                for request_id in list(in_flight):
                    sink.add(_server_error(request_id, "the engine finished without returning this request's output"))
                in_flight.clear()
            num_steps += 1
            if num_steps % check_every_steps == 0 or time.monotonic() - last_check_s >= CHECK_INTERVAL_S:
                last_check_s = time.monotonic()
                sink.flush()
                stop = _should_stop(batch_id, database_url, expires_at, clock)
                if stop is not None:
                    logger.info("batch %s: %s with %d lines in flight", batch_id, stop, len(in_flight))
                    _abort(engine, in_flight)
                    return stop
        return None
    finally:
        # NOTE: the engine outlives this batch; nothing of ours may linger in it after an error.
        _abort(engine, in_flight)


def _map_lines(
    engine: Engine, endpoint: str, pending: Iterable[tuple[str, dict[str, Any]]], sink: _ResultSink
) -> dict[str, MappedRequest]:
    mapped: dict[str, MappedRequest] = {}
    for request_id, body in pending:
        try:
            request = map_request(endpoint, body, engine.tokenizer)
        except InvalidRequest as exc:
            sink.add(_rejected(request_id, exc.message, param=exc.param, code=exc.code))
            continue
        mapped[request_id] = request
    return mapped


def _should_stop(batch_id: str, database_url: str | None, expires_at: int, clock: Callable[[], float]) -> str | None:
    if _current_status(batch_id, database_url) == BatchStatus.CANCELLING:
        return "cancelled"
    if clock() >= expires_at:
        return "expired"
    return None


def _abort(engine: Engine, in_flight: dict[str, MappedRequest]) -> None:
    for request_id in list(in_flight):
        try:
            engine.abort_request(request_id)
        except Exception:
            logger.exception("could not abort %s", request_id)
    in_flight.clear()


def _current_status(batch_id: str, database_url: str | None) -> BatchStatus:
    with session_scope(database_url) as session:
        return repository.batch_status(session, batch_id=batch_id)


def _finalize(batch_id: str, database_url: str | None, *, now: int) -> BatchStatus:
    """Terminal status from the rows: completed, or cancelled / expired with never-run lines marked."""
    with session_scope(database_url) as session:
        return BatchStatus(repository.finalize_batch(session, batch_id=batch_id, now=now).status)


def _completed(output: RequestOutput, request: MappedRequest, *, model_name: str, tokenizer: Any) -> LineResult:
    try:
        body = build_body(output, request, model=model_name, tokenizer=tokenizer)
    except Exception as exc:
        logger.exception("could not build the response body of %s", output.request_id)
        return _server_error(output.request_id, f"could not build the response body: {exc}")
    usage = body["usage"]
    return LineResult(
        request_id=output.request_id,
        response={"status_code": 200, "request_id": new_request_id(), "body": body},
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def _rejected(request_id: str, message: str, *, param: str | None, code: str | None = None) -> LineResult:
    body = error_envelope(message, type="invalid_request_error", param=param, code=code)
    return LineResult(
        request_id=request_id, response={"status_code": 400, "request_id": new_request_id(), "body": body}
    )


def _context_length_result(request_id: str, endpoint: str, exc: PromptTooLongError) -> LineResult:
    return _rejected(
        request_id,
        context_length_message(exc.num_prompt_tokens, exc.max_model_len),
        param="messages" if endpoint == CHAT_COMPLETIONS else "prompt",
        code="context_length_exceeded",
    )


def _server_error(request_id: str, message: str) -> LineResult:
    body = error_envelope(message, type="server_error", param=None, code="engine_error")
    return LineResult(
        request_id=request_id, response={"status_code": 500, "request_id": new_request_id(), "body": body}
    )

"""Run one shard of a batch: its pending lines through the engine as one stream, each result persisted as it lands.

Flow (plain functions; the Celery task in `worker.tasks` only calls `run_next_shard`):
1. Claim the next queued shard of this worker's model under a lease (`jobs.shards.claim_next_shard`: fair across batches,
   priority first) and load its pending lines (a shard run again resumes where the last run stopped:
   lines already recorded are not run again). A `worker.leases.LeaseKeeper` renews the lease.
2. Parse each line body with its endpoint's schema and map it to prompt token ids + `SamplingParams`
   (`worker.request_mapping`). A line the endpoint rejects (a bad field, a token id outside the
   vocabulary, a prompt longer than the context, a structured output constraint the grammar engine
   cannot compile: ``param`` names the body field it came from) gets a 400 ``response`` with an OpenAI error body
   and counts as failed; its neighbours run.
3. Order the lines by prompt token ids, so lines sharing a prefix are admitted together and hit the
   prefix cache (docs/engine.md, "Prefix caching"), and add them ALL to the engine; then step until
   done. Continuous batching keeps the running batch full; no line waits for another to finish. A line
   an interrupted run checkpointed resumes from its generated tokens (`worker.checkpointer`).
4. Record each finished line in the database as it finishes, committing in small groups so
   ``request_counts`` move while the shard runs; first result wins.
5. After every step, stop when a stop signal came (`worker.shutdown`) or the lease was lost; every
   few steps, look at the batch row and the lease: ``cancelling`` or ``expires_at`` passed aborts what
   is still running. Finished lines are kept in every case. Every ``Settings.checkpoint_interval_s``
   the lines in flight are checkpointed (their generated token ids, docs/operations.md, "Checkpoints").
6. End the shard: finished (every line recorded), handed back (a stop signal, or the batch stopped;
   the lines not run go back to the queue, never to the error file), or left alone (lease lost: the
   shard already belongs to someone else); a shard handed back checkpoints its lines in flight first.
   Then settle the batch (`jobs.shards.settle_batch`): the worker ending its last shard writes the
   output and error files.

After every engine step the runner hands the engine's statistics (`LLMEngine.make_stats`, take and
reset) and the requests that finished to a `StepObserver`: by default this process's
`worker.telemetry.WorkerTelemetry`, which feeds the Prometheus metrics and the heartbeat
(docs/architecture.md, "Observability").

``/v1/embeddings`` lines take their own path (`_embed_stream`): no engine steps, the lines are embedded in
chunks of about `EMBED_CHUNK_TOKENS` tokens by the engine's ``embed`` (`worker.embeddings`), with the same
stop and cancel checks between chunks. A line whose endpoint the served model does not serve (an embedding
line to a generating model, a chat line to an embedding model) gets a 400 naming the model.

A failure confined to one line (its mapping, its response body) fails that line only. An exception
out of ``engine.step()`` cannot be pinned on one line: the lines in flight get a 500 ``server_error``
response and the shard still ends, with everything finished before kept. Stopping the process is
never such a failure: an exception that arrives after a stop was asked for hands the shard back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kombu.exceptions import OperationalError as BrokerUnreachable

from jobs import repository, shards
from jobs.config import get_settings
from jobs.db import session_scope
from jobs.errors import InvalidRequest, error_envelope
from jobs.line_body import new_request_id, rejected_response
from jobs.queue import enqueue_shards
from jobs.schemas import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from jobs.status import BatchStatus
from jobs.storage import storage_from_settings
from worker.checkpointer import Checkpointer
from worker.embeddings import EmbeddingEngine, EmbeddingRequest, embedding_body, map_embedding_request
from worker.engine.errors import InvalidParameterError, PromptTooLongError, ResumeError
from worker.engine.outputs import RequestOutput, RequestProgress
from worker.engine.sampling_params import SamplingParams
from worker.engine.stats import EngineStats
from worker.leases import LeaseKeeper, this_worker_id
from worker.prefix_grouping import order_by_shared_prefix
from worker.request_mapping import MappedRequest, map_request
from worker.responses import build_body, context_length_message, usage

logger = logging.getLogger(__name__)

COMMIT_EVERY = 16
CHECK_EVERY_STEPS = 8
# NOTE: a CPU step over a large batch can take seconds; cancel must not wait for 8 of them.
CHECK_INTERVAL_S = 1.0
# NOTE: one embed call sorts its inputs by length and packs them by the engine's token budget; bigger calls
# pack better, smaller ones let cancel and stop checks come sooner (about a second of CPU work each).
EMBED_CHUNK_TOKENS = 32768


class Engine(Protocol):
    """The slice of `worker.engine.llm_engine.LLMEngine` the runner drives."""

    tokenizer: Any

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        resumed_token_ids: Sequence[int] = (),
    ) -> None: ...

    def progress(self) -> dict[str, RequestProgress]: ...

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

    def tokens_resumed(self, num_tokens: int) -> None:
        """Lines joined the engine resuming from checkpoints holding ``num_tokens`` generated tokens in all."""

    def tokens_recomputed(self, num_tokens: int) -> None:
        """An interrupted run threw away ``num_tokens`` generated tokens no checkpoint holds (`worker.checkpointer`)."""


class ShardEnd(StrEnum):
    """How a shard run ended."""

    FINISHED = "finished"
    """every line has its result"""
    CANCELLED = "cancelled"
    """the batch is cancelling: handed back, the batch settled"""
    EXPIRED = "expired"
    """the batch's window closed: handed back, the batch settled"""
    HANDED_BACK = "handed_back"
    """a stop signal: the lines not run are queued again"""
    LEASE_LOST = "lease_lost"
    """another worker holds the shard now (or the batch was finalized)"""


@dataclass(frozen=True, slots=True)
class ShardRun:
    """One `run_next_shard` call: which shard of which batch, how it ended, the batch's status after."""

    shard_id: str
    batch_id: str
    end: ShardEnd
    batch_status: BatchStatus
    num_recorded: int


@dataclass(frozen=True, slots=True)
class PendingLine:
    """A stored line still to run: its request row's id, its 1-based line number in the input file, its body,
    and the output token ids an interrupted run checkpointed (None: it starts from zero)."""

    request_id: str
    line_number: int
    body: dict[str, Any]
    checkpoint_token_ids: list[int] | None = None


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


def run_next_shard(
    *,
    engine: Engine | EmbeddingEngine | None = None,
    owner: str | None = None,
    model_name: str | None = None,
    database_url: str | None = None,
    commit_every: int = COMMIT_EVERY,
    check_every_steps: int = CHECK_EVERY_STEPS,
    clock: Callable[[], float] = time.time,
    observer: StepObserver | None = None,
    stop: threading.Event | None = None,
) -> ShardRun | None:
    """Claim the next queued shard, run its pending lines through ``engine``, end it, settle its batch.

    Args:
        engine: the engine to use; default this process's engine (`worker.bootstrap.get_engine`).
        owner: the lease holder's id; default ``host:pid``.
        model_name: the model name written in response bodies; default ``settings.served_model_name``.
        database_url: default ``settings.database_url``.
        commit_every: results per commit while the shard runs.
        check_every_steps: engine steps between looks at the batch row and the lease (cancel, expiry,
            a lease taken over); they are also looked at whenever ``CHECK_INTERVAL_S`` seconds passed.
        clock: Unix seconds (tests move time to expire a batch).
        observer: told about every engine step; default this process's `worker.telemetry.get_telemetry`.
        stop: set when the process must stop (`worker.shutdown.requested`): the shard is handed back
            after the current step.

    Returns:
        What happened, or None when no shard was waiting.

    Raises:
        BaseException: whatever interrupted the run (KeyboardInterrupt, SystemExit), after the lines
            already finished were recorded and the shard was handed back.
    """
    settings = get_settings()
    stop = stop or threading.Event()
    with session_scope(database_url) as session:
        lease = shards.claim_next_shard(
            session,
            owner=owner or this_worker_id(),
            now=clock(),
            lease_s=settings.lease_expiry_s,
            model=settings.served_model_name,
        )
        pending = (
            []
            if lease is None
            else [
                PendingLine(r.id, r.line_number, r.body, r.checkpoint_token_ids)
                for r in repository.pending_requests(session, batch_id=lease.batch_id, shard_id=lease.shard_id)
            ]
        )
    if lease is None:
        return None
    logger.info("shard %s of batch %s: %d lines to run", lease.shard_id, lease.batch_id, len(pending))
    sink = _ResultSink(database_url, commit_every)
    keeper = LeaseKeeper(
        lease, database_url=database_url, renew_s=settings.lease_renew_s, expiry_s=settings.lease_expiry_s
    )
    keeper.start()
    try:
        end = _run_lines(
            lease,
            pending,
            sink,
            engine=engine,
            model_name=model_name or settings.served_model_name,
            database_url=database_url,
            check_every_steps=check_every_steps,
            clock=clock,
            observer=observer,
            checkpoint_interval_s=settings.checkpoint_interval_s,
            should_stop=lambda: (
                ShardEnd.HANDED_BACK if stop.is_set() else (ShardEnd.LEASE_LOST if keeper.lost.is_set() else None)
            ),
        )
        sink.flush()
    except BaseException:
        logger.warning("shard %s interrupted; recording what finished and handing it back", lease.shard_id)
        _hand_back_after_interrupt(lease, sink, database_url)
        raise
    finally:
        keeper.stop()
    status = _end_shard(lease, end, database_url, now=clock())
    logger.info(
        "shard %s of batch %s: %d lines recorded, %s; batch %s",
        lease.shard_id,
        lease.batch_id,
        sink.num_recorded,
        end.value,
        status.value,
    )
    return ShardRun(lease.shard_id, lease.batch_id, end, status, sink.num_recorded)


def _run_lines(
    lease: shards.Lease,
    pending: list[PendingLine],
    sink: _ResultSink,
    *,
    engine: Engine | EmbeddingEngine | None,
    model_name: str,
    database_url: str | None,
    check_every_steps: int,
    clock: Callable[[], float],
    observer: StepObserver | None,
    checkpoint_interval_s: float,
    should_stop: Callable[[], ShardEnd | None],
) -> ShardEnd:
    if not pending:
        return ShardEnd.FINISHED
    if engine is None:
        from worker.bootstrap import get_engine

        engine = get_engine()
    if observer is None:
        from worker.telemetry import get_telemetry

        observer = get_telemetry(model_name, getattr(engine, "max_model_len", 8192))
    observer.batch_started(lease.batch_id)
    try:
        if lease.endpoint == EMBEDDINGS or isinstance(engine, EmbeddingEngine):
            return _embed_stream(
                engine,
                lease,
                pending,
                sink,
                model_name=model_name,
                database_url=database_url,
                clock=clock,
                observer=observer,
                should_stop=should_stop,
            )
        return _stream(
            engine,
            lease,
            pending,
            sink,
            model_name=model_name,
            database_url=database_url,
            check_every_steps=check_every_steps,
            clock=clock,
            observer=observer,
            checkpointer=Checkpointer(lease, database_url, checkpoint_interval_s),
            should_stop=should_stop,
        )
    finally:
        observer.batch_ended()


def _end_shard(lease: shards.Lease, end: ShardEnd, database_url: str | None, *, now: float) -> BatchStatus:
    """Finish or hand back the shard (unless its lease is lost), then settle the batch."""
    storage = storage_from_settings(get_settings())
    with session_scope(database_url) as session:
        if end == ShardEnd.FINISHED:
            shards.finish_shard(session, lease=lease, now=int(now))
        elif end != ShardEnd.LEASE_LOST:
            shards.hand_back_shard(session, lease=lease)
        status = shards.settle_batch(session, batch_id=lease.batch_id, now=now, storage=storage)
    if end == ShardEnd.HANDED_BACK and status == BatchStatus.IN_PROGRESS:
        _send_message_for(lease)
    return status


def _hand_back_after_interrupt(lease: shards.Lease, sink: _ResultSink, database_url: str | None) -> None:
    """Best effort on the way out of an interrupted run: record what finished, hand the shard back."""
    try:
        sink.flush()
        with session_scope(database_url) as session:
            shards.hand_back_shard(session, lease=lease)
    except Exception:
        logger.exception("shard %s: could not hand it back; its lease will lapse instead", lease.shard_id)
        return
    _send_message_for(lease)


def _send_message_for(lease: shards.Lease) -> None:
    try:
        enqueue_shards(1)
    except BrokerUnreachable as exc:
        logger.warning("shard %s handed back; broker unreachable (%s), the reaper will queue it", lease.shard_id, exc)


def _stream(
    engine: Engine,
    lease: shards.Lease,
    pending: list[PendingLine],
    sink: _ResultSink,
    *,
    model_name: str,
    database_url: str | None,
    check_every_steps: int,
    clock: Callable[[], float],
    observer: StepObserver,
    checkpointer: Checkpointer,
    should_stop: Callable[[], ShardEnd | None],
) -> ShardEnd:
    """Feed all lines (a checkpointed one resumes from its tokens), step until done (`ShardEnd.FINISHED`) or
    until told to stop (how, returned); lines in flight are checkpointed as they run and when handed back."""
    endpoint, batch_id = lease.endpoint, lease.batch_id
    mapped = _map_lines(engine, endpoint, pending, sink)
    in_flight: dict[str, MappedRequest] = {}
    try:
        admission_order = order_by_shared_prefix([request.prompt_token_ids for _, request in mapped])
        for line, request in (mapped[index] for index in admission_order):
            request_id = line.request_id
            try:
                if not _resume(engine, line, request, checkpointer, observer):
                    engine.add_request(request_id, request.prompt_token_ids, request.params)
            except PromptTooLongError as exc:
                sink.add(_context_length_result(request_id, line.line_number, endpoint, exc))
                continue
            except InvalidParameterError as exc:
                param = exc.param
                if param == "structured_outputs" and request.structured_outputs_param is not None:
                    param = request.structured_outputs_param  # the body field the constraint came from
                sink.add(_rejected(request_id, line.line_number, str(exc), param=param, code="invalid_value"))
                continue
            except ValueError as exc:
                sink.add(_rejected(request_id, line.line_number, str(exc), param=None))
                continue
            in_flight[request_id] = request

        num_steps, last_check_s = 0, time.monotonic()
        while in_flight:
            try:
                outputs = engine.step()
            except Exception as exc:
                stop = should_stop()
                if stop is not None:
                    # NOTE: an error while the process is being stopped is the stop's doing, not the lines'.
                    logger.warning("batch %s: engine step interrupted (%s) while stopping: %s", batch_id, exc, stop)
                    _interrupt(engine, in_flight, stop, checkpointer, observer)
                    return stop
                logger.exception("batch %s: engine step failed; failing %d lines in flight", batch_id, len(in_flight))
                for request_id in list(in_flight):
                    sink.add(_server_error(request_id, f"the engine failed while running this request: {exc}"))
                _abort(engine, in_flight)
                return ShardEnd.FINISHED
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
            stop = should_stop()
            if stop is None and (
                num_steps % check_every_steps == 0 or time.monotonic() - last_check_s >= CHECK_INTERVAL_S
            ):
                last_check_s = time.monotonic()
                sink.flush()
                stop = _batch_stopped(lease, database_url, clock)
            if stop is not None and in_flight:
                logger.info("batch %s: %s with %d lines in flight", batch_id, stop.value, len(in_flight))
                _interrupt(engine, in_flight, stop, checkpointer, observer)
                _abort(engine, in_flight)
                return stop
            checkpointer.maybe_save(engine, in_flight)
        return ShardEnd.FINISHED
    finally:
        # NOTE: the engine outlives this batch; nothing of ours may linger in it after an error.
        _abort(engine, in_flight)


def _embed_stream(
    engine: Engine | EmbeddingEngine,
    lease: shards.Lease,
    pending: list[PendingLine],
    sink: _ResultSink,
    *,
    model_name: str,
    database_url: str | None,
    clock: Callable[[], float],
    observer: StepObserver,
    should_stop: Callable[[], ShardEnd | None],
) -> ShardEnd:
    """Embed the lines chunk by chunk (`EMBED_CHUNK_TOKENS`), recording each chunk's results; between chunks,
    stop when told to or when the batch stopped (the lines not embedded are handed back: nothing is in flight).

    The engine must be an embedding one for a ``/v1/embeddings`` batch, and only then: every line of a
    mismatched pair is a 400 naming the model. An ``embed`` call that raises fails its chunk's lines with a
    500; the other chunks run.
    """
    if lease.endpoint != EMBEDDINGS or not isinstance(engine, EmbeddingEngine):
        message = (
            f"model {model_name!r} generates text; {EMBEDDINGS} needs an embedding model"
            if lease.endpoint == EMBEDDINGS
            else f"model {model_name!r} is an embedding model; it serves {EMBEDDINGS} only, not {lease.endpoint}"
        )
        for line in pending:
            sink.add(_rejected(line.request_id, line.line_number, message, param="model", code="model_not_supported"))
        return ShardEnd.FINISHED
    mapped: list[tuple[PendingLine, EmbeddingRequest]] = []
    for line in pending:
        try:
            mapped.append((line, map_embedding_request(line.body, engine)))
        except InvalidRequest as exc:
            sink.add(_rejected(line.request_id, line.line_number, exc.message, param=exc.param, code=exc.code))
    start = 0
    while start < len(mapped):
        end, num_tokens = start, 0
        while end < len(mapped) and (end == start or num_tokens + mapped[end][1].num_tokens <= EMBED_CHUNK_TOKENS):
            num_tokens += mapped[end][1].num_tokens
            end += 1
        # NOTE: the chunk's lines are the running requests while it is embedded (the gauge and the heartbeat).
        observer.step_done(EngineStats(num_running_reqs=end - start, num_waiting_reqs=len(mapped) - end), [])
        started_s = time.perf_counter()
        for result in _embed_chunk(engine, mapped[start:end], model_name):
            sink.add(result)
        stats = EngineStats(
            num_steps=1,
            num_prompt_tokens_computed=num_tokens,
            num_prompt_tokens=num_tokens,
            num_waiting_reqs=len(mapped) - end,
            forward_s=time.perf_counter() - started_s,
        )
        observer.step_done(stats, [])
        start = end
        stop = should_stop()
        if stop is None and start < len(mapped):
            sink.flush()
            stop = _batch_stopped(lease, database_url, clock)
        if stop is not None and start < len(mapped):
            logger.info("batch %s: %s with %d lines not embedded", lease.batch_id, stop.value, len(mapped) - start)
            return stop
    return ShardEnd.FINISHED


def _embed_chunk(
    engine: EmbeddingEngine, chunk: list[tuple[PendingLine, EmbeddingRequest]], model_name: str
) -> list[LineResult]:
    """The results of one chunk of lines: one ``embed`` call per distinct ``dimensions`` among them."""
    results: list[LineResult] = []
    for dimensions in dict.fromkeys(request.dimensions for _, request in chunk):
        group = [(line, request) for line, request in chunk if request.dimensions == dimensions]
        try:
            embeddings = engine.embed(
                [ids for _, request in group for ids in request.prompt_token_ids], dimensions=dimensions
            )
        except Exception as exc:
            logger.exception("embedding %d lines failed", len(group))
            results += [
                _server_error(line.request_id, f"the engine failed while embedding: {exc}") for line, _ in group
            ]
            continue
        offset = 0
        for line, request in group:
            rows = embeddings[offset : offset + len(request.prompt_token_ids)]
            offset += len(request.prompt_token_ids)
            body = embedding_body(rows, request, model=model_name)
            results.append(
                LineResult(
                    request_id=line.request_id,
                    response={"status_code": 200, "request_id": new_request_id(), "body": body},
                    prompt_tokens=request.num_tokens,
                )
            )
    return results


def _resume(
    engine: Engine, line: PendingLine, request: MappedRequest, checkpointer: Checkpointer, observer: StepObserver
) -> bool:
    """Add a checkpointed line resuming from its tokens; False (nothing added) when it has no checkpoint or
    cannot resume from it (`LLMEngine.add_request` raised `ResumeError`): it then starts from zero.

    Raises:
        PromptTooLongError, InvalidParameterError, ValueError: as `LLMEngine.add_request`, for the line's body.
    """
    token_ids = line.checkpoint_token_ids
    if not token_ids:
        return False
    try:
        engine.add_request(line.request_id, request.prompt_token_ids, request.params, resumed_token_ids=token_ids)
    except ResumeError as exc:
        logger.warning("line %d: not resumed from its checkpoint (%s); starting it again", line.line_number, exc)
        return False
    logger.info("line %d: resuming from its checkpoint of %d generated tokens", line.line_number, len(token_ids))
    checkpointer.resumed(line.request_id, len(token_ids))
    observer.tokens_resumed(len(token_ids))
    return True


def _interrupt(
    engine: Engine,
    in_flight: dict[str, MappedRequest],
    stop: ShardEnd,
    checkpointer: Checkpointer,
    observer: StepObserver,
) -> None:
    """Before the lines in flight are aborted: checkpoint them when the shard is handed back; count the
    generated tokens thrown away (handed back or lease lost; a stopped batch never runs them again)."""
    try:
        if stop == ShardEnd.HANDED_BACK:
            num_recomputed = checkpointer.save_final(engine, in_flight)
        elif stop == ShardEnd.LEASE_LOST:
            num_recomputed = checkpointer.discard(engine, in_flight)
        else:
            return
    except Exception:
        logger.exception("could not checkpoint the lines in flight")
        return
    logger.info(
        "%d lines in flight %s; %d generated tokens not checkpointed", len(in_flight), stop.value, num_recomputed
    )
    if num_recomputed:
        observer.tokens_recomputed(num_recomputed)


def _map_lines(
    engine: Engine, endpoint: str, pending: Iterable[PendingLine], sink: _ResultSink
) -> list[tuple[PendingLine, MappedRequest]]:
    """Each line with its engine request; a body its endpoint refuses becomes that line's 400 instead."""
    mapped: list[tuple[PendingLine, MappedRequest]] = []
    for line in pending:
        try:
            request = map_request(endpoint, line.body, engine.tokenizer)
        except InvalidRequest as exc:
            sink.add(_rejected(line.request_id, line.line_number, exc.message, param=exc.param, code=exc.code))
            continue
        mapped.append((line, request))
    return mapped


def _batch_stopped(lease: shards.Lease, database_url: str | None, clock: Callable[[], float]) -> ShardEnd | None:
    """Whether the batch was cancelled, expired or finalized, or the lease was taken over."""
    with session_scope(database_url) as session:
        status = repository.batch_status(session, batch_id=lease.batch_id)
        held = shards.holds_lease(session, lease=lease)
    if status == BatchStatus.CANCELLING:
        return ShardEnd.CANCELLED
    if status != BatchStatus.IN_PROGRESS or clock() >= lease.batch_expires_at:
        return ShardEnd.EXPIRED if status in (BatchStatus.IN_PROGRESS, BatchStatus.EXPIRED) else ShardEnd.CANCELLED
    if not held:
        return ShardEnd.LEASE_LOST
    return None


def _abort(engine: Engine, in_flight: dict[str, MappedRequest]) -> None:
    for request_id in list(in_flight):
        try:
            engine.abort_request(request_id)
        except Exception:
            logger.exception("could not abort %s", request_id)
    in_flight.clear()


def _completed(output: RequestOutput, request: MappedRequest, *, model_name: str, tokenizer: Any) -> LineResult:
    try:
        body = build_body(output, request, model=model_name, tokenizer=tokenizer)
    except Exception as exc:
        logger.exception("could not build the response body of %s", output.request_id)
        return _server_error(output.request_id, f"could not build the response body: {exc}")
    counts = usage(output)
    return LineResult(
        request_id=output.request_id,
        response={"status_code": 200, "request_id": new_request_id(), "body": body},
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        cached_tokens=counts["prompt_tokens_details"]["cached_tokens"],
    )


def _rejected(
    request_id: str, line_number: int, message: str, *, param: str | None, code: str | None = None
) -> LineResult:
    """A 400 for one line whose body the endpoint or the engine refuses; the message names the line."""
    return LineResult(request_id=request_id, response=rejected_response(line_number, message, param=param, code=code))


def _context_length_result(request_id: str, line_number: int, endpoint: str, exc: PromptTooLongError) -> LineResult:
    return _rejected(
        request_id,
        line_number,
        context_length_message(exc.num_prompt_tokens, exc.max_model_len),
        param={CHAT_COMPLETIONS: "messages", RESPONSES: "input"}.get(endpoint, "prompt"),
        code="context_length_exceeded",
    )


def _server_error(request_id: str, message: str) -> LineResult:
    body = error_envelope(message, type="server_error", param=None, code="engine_error")
    return LineResult(
        request_id=request_id, response={"status_code": 500, "request_id": new_request_id(), "body": body}
    )

"""SQLAlchemy 2.0 tables: ``files``, ``batches``, ``batch_requests`` (one row per input line),
``batch_shards`` (a batch's lines in leased units of work), ``schedules``, ``workers`` (one heartbeat row
per worker process), ``api_keys``, ``file_chunks`` (file bytes kept in the database,
`jobs.storage.DatabaseStorage`), and the evaluations: ``evals``, ``eval_runs``, ``eval_output_items``
(`jobs.evals`).

``owner_key_id`` on files, batches and schedules is the API key that created the row (None: created
while the deployment had no key); see `jobs.api_keys`.

Timestamps are Unix seconds (``BigInteger``), as the API returns them. JSON columns hold what the
API returns verbatim (``errors``, ``metadata``, a line's ``body``, ``response`` and ``error``).
The schema is created by the Alembic migrations in ``migrations/``, never by ``create_all``.
"""

from __future__ import annotations

import secrets
import time
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobs.status import BatchStatus

FILE_ID_PREFIX = "file-"
BATCH_ID_PREFIX = "batch_"
REQUEST_ID_PREFIX = "batch_req_"
SCHEDULE_ID_PREFIX = "sched_"
API_KEY_ID_PREFIX = "key_"
SHARD_ID_PREFIX = "shard_"
EVAL_ID_PREFIX = "eval_"
EVAL_RUN_ID_PREFIX = "evalrun_"
EVAL_OUTPUT_ITEM_ID_PREFIX = "outputitem_"


def new_id(prefix: str) -> str:
    """A fresh id such as ``batch_661932c45eb92f34a8fa996a`` (prefix + 24 hex characters): the creation time in
    microseconds (13 hex characters), then 44 random bits. Ids made later sort later, so lists ordered by
    ``(created_at, id)`` keep the creation order of objects made within the same second."""
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)[:11]}"


class Base(DeclarativeBase):
    pass


class RequestState(StrEnum):
    """Where one input line stands: not run yet, answered with status 200, or anything else."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class ShardState(StrEnum):
    """Where one shard stands: waiting for a worker, leased by one, every line recorded, or given up on."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class File(Base):
    """An uploaded input file or a generated output/error file; its bytes are stored under ``storage_path``
    (`jobs.storage`)."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    num_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    storage_path: Mapped[str] = mapped_column(String(512))
    owner_key_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (Index("ix_files_owner_key_id_created_at", "owner_key_id", "created_at"),)


class FileChunk(Base):
    """One piece (at most 1 MiB) of a file's bytes when files live in the database; ``seq`` counts from 0."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class ApiKey(Base):
    """A bearer key of the HTTP API; only its SHA-256 (``key_hash``, hex) is stored.

    ``key_prefix`` is the key's first characters, shown by ``batchinfer keys ls`` so a person can tell
    keys apart; ``revoked_at`` (Unix seconds) is set once the key is revoked.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(256))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)


class Batch(Base):
    """One batch job; field names follow the OpenAI batch object.

    ``started_at`` is internal: set when a worker claims the batch's first shard
    (`jobs.shards.claim_next_shard`). ``errors`` holds the first `jobs.validation.MAX_ERRORS` input-file
    errors, ``num_errors`` counts them all (None on rows older than that count: ``len(errors)``).
    """

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING.value)
    model: Mapped[str | None] = mapped_column(String(256))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    num_errors: Mapped[int | None] = mapped_column(Integer)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))

    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[int | None] = mapped_column(BigInteger)
    owner_key_id: Mapped[str | None] = mapped_column(String(64))

    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (
        Index("ix_batches_created_at_id", "created_at", "id"),
        Index("ix_batches_owner_key_id_created_at", "owner_key_id", "created_at"),
    )


class BatchRequest(Base):
    """One input line and, once run, its result.

    ``response`` is ``{status_code, request_id, body}`` (OpenAI's output-line ``response``) or None;
    ``error`` is ``{code, message}`` or None. ``state`` is `RequestState`. ``shard_id`` is the
    `BatchShard` the line was put in at validation. While the line runs, ``checkpoint_token_ids`` holds the
    output token ids a worker generated so far (`jobs.checkpoints`; None once the result is recorded), and
    ``recomputed_tokens`` counts generated tokens that interrupted runs threw away after their last
    checkpoint (they were generated again). ``custom_id`` is None when PostgreSQL text cannot
    hold it (`jobs.storable_text`): ``custom_id_sent`` (JSON, which escapes it) has it then, and the
    line was answered with a 400 at validation.
    """

    __tablename__ = "batch_requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line_number: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(512))
    custom_id_sent: Mapped[str | None] = mapped_column(JSON)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default=RequestState.PENDING.value)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)
    shard_id: Mapped[str | None] = mapped_column(String(64))
    checkpoint_token_ids: Mapped[list[int] | None] = mapped_column(JSON)
    recomputed_tokens: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (
        UniqueConstraint("batch_id", "line_number", name="uq_batch_requests_batch_id_line_number"),
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_requests_batch_id_custom_id"),
        Index("ix_batch_requests_batch_id_state", "batch_id", "state"),
        Index("ix_batch_requests_shard_id_state", "shard_id", "state"),
    )


class BatchShard(Base):
    """A group of a batch's lines that one worker runs at a time under a lease (`jobs.shards`).

    ``state`` is `ShardState`. While ``running``, ``lease_token`` names the claim (a fresh random
    value per claim), ``lease_owner`` the worker (``host:pid``) and ``lease_expires_at`` (Unix
    seconds, fractional) when the lease lapses unless renewed. ``attempts`` counts claims that were
    not handed back (a worker that died with the shard counts; a graceful stop does not).
    ``num_tokens`` is the estimate the shard was cut by; ``priority`` comes from the batch's
    ``metadata["priority"]`` (higher runs first).
    """

    __tablename__ = "batch_shards"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    shard_index: Mapped[int] = mapped_column(Integer)
    num_requests: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default=ShardState.QUEUED.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_owner: Mapped[str | None] = mapped_column(String(320))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[int] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("batch_id", "shard_index", name="uq_batch_shards_batch_id_shard_index"),
        Index("ix_batch_shards_state_lease_expires_at", "state", "lease_expires_at"),
        Index("ix_batch_shards_batch_id_state", "batch_id", "state"),
    )


class Schedule(Base):
    """A scheduled evaluation run: at every tick of ``cron``, a batch of ``input_file_id`` (``endpoint``),
    or a run of eval ``eval_id`` from ``run_spec`` (the ``POST /v1/evals/{eval_id}/runs`` body).

    ``cron`` is a 5-field cron expression evaluated in UTC; ``next_run_at`` is the next tick (Unix
    seconds), ``last_run_at`` / ``last_batch_id`` (/ ``last_run_id``) the latest tick that fired and the
    batch (eval run) it made (see `jobs.schedules`).
    """

    __tablename__ = "schedules"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    cron: Mapped[str] = mapped_column(String(128))
    input_file_id: Mapped[str | None] = mapped_column(String(64))
    endpoint: Mapped[str | None] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)
    next_run_at: Mapped[int] = mapped_column(BigInteger)
    last_run_at: Mapped[int | None] = mapped_column(BigInteger)
    last_batch_id: Mapped[str | None] = mapped_column(String(64))
    eval_id: Mapped[str | None] = mapped_column(String(64))
    run_spec: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    last_run_id: Mapped[str | None] = mapped_column(String(64))
    owner_key_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_schedules_created_at_id", "created_at", "id"),
        Index("ix_schedules_owner_key_id_created_at", "owner_key_id", "created_at"),
        Index("ix_schedules_next_run_at", "next_run_at"),
    )


class Worker(Base):
    """A worker process's latest heartbeat (`jobs.workers.record_heartbeat`), rewritten every few seconds.

    ``id`` is ``host:pid``; ``current_batch_id`` is the batch it is running (None when idle);
    ``tokens_per_s`` is its generation tokens per second over the last minute; ``metrics_port`` the
    port of its Prometheus ``/metrics`` (None when not served); ``ready_s`` the seconds from its
    process's start until it was ready to take shards (engine loaded and warmed up, consuming
    messages), None while it is still starting. ``kv_cache_dtype``, ``num_kv_blocks`` and ``kv_cache_bytes``
    describe its engine's KV cache (all layers, K and V, scales included; None until the engine is up, and for an
    engine without one); ``dtype`` and ``quantization`` its engine's compute dtype and weight quantization (None
    until the engine is up).
    """

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(320), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(256))
    device: Mapped[str] = mapped_column(String(32))
    current_batch_id: Mapped[str | None] = mapped_column(String(64))
    num_running_requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    metrics_port: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[int] = mapped_column(BigInteger)
    last_heartbeat_at: Mapped[int] = mapped_column(BigInteger)
    ready_s: Mapped[float | None] = mapped_column(Float)
    kv_cache_dtype: Mapped[str | None] = mapped_column(String(16))
    num_kv_blocks: Mapped[int | None] = mapped_column(Integer)
    kv_cache_bytes: Mapped[int | None] = mapped_column(BigInteger)
    dtype: Mapped[str | None] = mapped_column(String(16))
    quantization: Mapped[str | None] = mapped_column(String(16))

    __table_args__ = (Index("ix_workers_last_heartbeat_at", "last_heartbeat_at"),)


class Eval(Base):
    """An evaluation (OpenAI's Evals API ``eval`` object): the schema of its items and its graders.

    ``data_source_config`` is the API's ``{type: "custom", item_schema, include_sample_schema}``;
    ``testing_criteria`` the graders as the API returns them (`jobs.evals.criteria`).
    """

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSON)
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)
    owner_key_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_evals_created_at_id", "created_at", "id"),
        Index("ix_evals_owner_key_id_created_at", "owner_key_id", "created_at"),
    )


class EvalRun(Base):
    """One run of an eval over a data source: its batch (None when nothing is generated) and its scores.

    ``status`` is `jobs.evals.runs.RunStatus`; ``num_*`` are the API's ``result_counts``;
    ``per_testing_criteria_results`` is ``[{testing_criteria, passed, failed}]`` in the eval's order;
    ``error`` is ``{code, message}`` or None; ``completed_at`` (Unix s) is set when grading ends.
    """

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(512))
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    data_source: Mapped[dict[str, Any]] = mapped_column(JSON)
    batch_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    num_total: Mapped[int] = mapped_column(Integer, default=0)
    num_passed: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    num_errored: Mapped[int] = mapped_column(Integer, default=0)
    per_testing_criteria_results: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    owner_key_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_eval_runs_eval_id_created_at", "eval_id", "created_at"),
        Index("ix_eval_runs_batch_id", "batch_id"),
        Index("ix_eval_runs_status", "status"),
    )


class EvalOutputItem(Base):
    """One data item of a run and, once graded, its sample and grader results.

    ``custom_id`` is the item's batch line ``custom_id`` (its index as text; None when the item made no
    line: it failed ``item_schema`` or its templates, or the data source generates nothing).
    ``status`` is ``pending`` until graded, then ``pass``, ``fail`` or ``error``; ``results`` is the API's
    ``[{name, type, score, passed, sample, ...}]``, ``sample`` the API's sample object.
    """

    __tablename__ = "eval_output_items"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"))
    eval_id: Mapped[str] = mapped_column(String(64))
    datasource_item_id: Mapped[int] = mapped_column(Integer)
    datasource_item: Mapped[dict[str, Any]] = mapped_column(JSON)
    given_sample: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    custom_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    results: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    sample: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("run_id", "datasource_item_id", name="uq_eval_output_items_run_id_item_id"),
        Index("ix_eval_output_items_run_id_status", "run_id", "status"),
        Index("ix_eval_output_items_run_id_custom_id", "run_id", "custom_id"),
    )

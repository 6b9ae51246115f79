"""Worker heartbeats: each worker process rewrites its ``workers`` row every few seconds; a row is
*live* while its heartbeat is younger than ``Settings.worker_live_s`` (docs/architecture.md, "Observability").

Data functions (keyword-only; the caller owns the transaction) and `WorkerObject`, the shape
``GET /v1/workers`` and the jobs page show (`live_worker_objects`: every key sees every worker, but a
worker's ``current_batch_id`` only when that key owns the batch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from jobs.models import Batch, Worker


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """A worker engine's KV cache: its ``kv_cache_dtype``, ``num_blocks`` and ``num_bytes`` (all layers, K and V,
    scales included; docs/engine.md, "Quantized KV cache")."""

    kv_cache_dtype: str
    num_blocks: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class EngineFormat:
    """What a worker engine computes in: its ``dtype`` (torch's name: ``float32``, ``bfloat16``, ``float16``) and
    its weights' ``quantization`` (``none``, ``int8``, ``q4``; an embedding engine's: ``none``)."""

    dtype: str
    quantization: str


class WorkerObject(BaseModel):
    """A live worker as the API returns it (batchinfer's own object; ``*_at`` are Unix seconds)."""

    object: Literal["worker"] = "worker"
    id: str
    host: str
    pid: int
    model: str
    device: str
    current_batch_id: str | None
    num_running_requests: int
    tokens_per_s: float
    metrics_port: int | None
    started_at: int
    last_heartbeat_at: int
    ready_s: float | None
    """Seconds from the process's start until it took work; null while it is starting (loading the model)."""
    kv_cache_dtype: str | None = None
    """The engine's ``kv_cache_dtype`` (``auto``, ``int8``, ``fp8_e4m3``, ``int4``); null while it is starting."""
    num_kv_blocks: int | None = None
    """KV cache blocks (``block_size`` tokens each); null while it is starting."""
    kv_cache_bytes: int | None = None
    """KV cache bytes (all layers, K and V, scales included); null while it is starting."""
    dtype: str | None = None
    """The engine's compute dtype (``float32``, ``bfloat16``, ``float16``); null while it is starting."""
    quantization: str | None = None
    """The engine's weight quantization (``none``, ``int8``, ``q4``; ``none`` for an embedding model); null while
    it is starting."""

    @classmethod
    def from_row(cls, worker: Worker, *, show_batch: bool = True) -> WorkerObject:
        """The row as returned; ``show_batch=False`` hides ``current_batch_id`` (another key's batch)."""
        return cls(
            id=worker.id,
            host=worker.host,
            pid=worker.pid,
            model=worker.model,
            device=worker.device,
            current_batch_id=worker.current_batch_id if show_batch else None,
            num_running_requests=worker.num_running_requests,
            tokens_per_s=worker.tokens_per_s,
            metrics_port=worker.metrics_port,
            started_at=worker.started_at,
            last_heartbeat_at=worker.last_heartbeat_at,
            ready_s=worker.ready_s,
            kv_cache_dtype=worker.kv_cache_dtype,
            num_kv_blocks=worker.num_kv_blocks,
            kv_cache_bytes=worker.kv_cache_bytes,
            dtype=worker.dtype,
            quantization=worker.quantization,
        )


class WorkerList(BaseModel):
    """``GET /v1/workers``: every live worker, most recently started first."""

    object: Literal["list"] = "list"
    data: list[WorkerObject]


def record_heartbeat(
    session: Session,
    *,
    worker_id: str,
    host: str,
    pid: int,
    model: str,
    device: str,
    current_batch_id: str | None,
    num_running_requests: int,
    tokens_per_s: float,
    metrics_port: int | None,
    started_at: int,
    now: int,
    ready_s: float | None = None,
    kv_cache: KVCacheSize | None = None,
    engine_format: EngineFormat | None = None,
) -> None:
    """Insert or rewrite the worker's row with its current state and ``last_heartbeat_at = now``
    (``ready_s``: seconds from its start until it was ready; ``kv_cache``: its engine's cache, None while
    starting or for an engine without one; ``engine_format``: its engine's dtype and quantization, None while
    starting)."""
    worker = session.get(Worker, worker_id)
    if worker is None:
        worker = Worker(id=worker_id)
        session.add(worker)
    worker.host, worker.pid, worker.model, worker.device = host, pid, model, device
    worker.current_batch_id, worker.num_running_requests = current_batch_id, num_running_requests
    worker.tokens_per_s, worker.metrics_port = tokens_per_s, metrics_port
    worker.started_at, worker.last_heartbeat_at, worker.ready_s = started_at, now, ready_s
    if kv_cache is not None:
        worker.kv_cache_dtype = kv_cache.kv_cache_dtype
        worker.num_kv_blocks, worker.kv_cache_bytes = kv_cache.num_blocks, kv_cache.num_bytes
    if engine_format is not None:
        worker.dtype, worker.quantization = engine_format.dtype, engine_format.quantization


def remove_worker(session: Session, *, worker_id: str) -> None:
    """Delete the worker's row (a worker shutting down cleanly); an unknown id is ignored."""
    session.execute(delete(Worker).where(Worker.id == worker_id))


def list_live_workers(session: Session, *, now: int, live_s: float) -> list[Worker]:
    """Workers whose last heartbeat is at most ``live_s`` seconds before ``now``, most recently started first."""
    query = select(Worker).where(Worker.last_heartbeat_at >= now - live_s)
    return list(session.scalars(query.order_by(Worker.started_at.desc(), Worker.id)))


def live_worker_objects(session: Session, *, now: int, live_s: float, owner: str | None) -> list[WorkerObject]:
    """`list_live_workers` as API key ``owner`` may see them: a worker running a batch of another key
    shows no ``current_batch_id`` (None: the open deployment, which has no keys, sees every batch id)."""
    rows = list_live_workers(session, now=now, live_s=live_s)
    if owner is None:
        return [WorkerObject.from_row(row) for row in rows]
    batch_ids = {row.current_batch_id for row in rows if row.current_batch_id is not None}
    owned = (
        set(session.scalars(select(Batch.id).where(Batch.id.in_(batch_ids), Batch.owner_key_id == owner)))
        if batch_ids
        else set()
    )
    return [WorkerObject.from_row(row, show_batch=row.current_batch_id in owned) for row in rows]


def waits_for_workers(status: str, *, num_done: int, total: int) -> bool:
    """Whether a batch in ``status`` with ``num_done`` of ``total`` lines done still needs a worker:
    ``validating`` (its lines are about to be queued), or ``in_progress`` with lines left to run."""
    return status == "validating" or (status == "in_progress" and num_done < total)


@dataclass(frozen=True, slots=True)
class WorkerReadiness:
    """How many live workers can take a shard now (``num_ready``) and how many are still starting;
    ``model``: the model they serve (None: every live worker, whatever its model). ``dtypes``,
    ``quantizations`` and ``kv_cache_dtypes``: the distinct values those workers' engines report (sorted; a
    worker still loading reports none), so a reader can tell what they run from what is configured."""

    num_ready: int
    num_starting: int
    model: str | None = None
    dtypes: tuple[str, ...] = ()
    quantizations: tuple[str, ...] = ()
    kv_cache_dtypes: tuple[str, ...] = ()

    def waiting_note(self) -> str | None:
        """What a batch with lines to run is waiting for when no worker is ready, else None:
        ``"waiting: no worker serves model M"`` (no live worker of the batch's model),
        ``"waiting: no worker is ready (1 starting)"``, or ``"(none running)"`` without a model."""
        if self.num_ready:
            return None
        if self.model is not None and not self.num_starting:
            return f"waiting: no worker serves model {self.model}"
        starting = f"{self.num_starting} starting" if self.num_starting else "none running"
        return f"waiting: no worker is ready ({starting})"

    @classmethod
    def of(cls, workers: Iterable[Worker | WorkerObject], *, model: str | None = None) -> WorkerReadiness:
        """Count ``workers`` (live ones) that serve ``model`` (None: all), ready and starting."""
        serving = [worker for worker in workers if model is None or worker.model == model]
        num_ready = sum(worker.ready_s is not None for worker in serving)

        def reported(values: Iterable[str | None]) -> tuple[str, ...]:
            return tuple(sorted({value for value in values if value is not None}))

        return cls(
            num_ready=num_ready,
            num_starting=len(serving) - num_ready,
            model=model,
            dtypes=reported(worker.dtype for worker in serving),
            quantizations=reported(worker.quantization for worker in serving),
            kv_cache_dtypes=reported(worker.kv_cache_dtype for worker in serving),
        )


def worker_readiness(session: Session, *, now: int, live_s: float, model: str | None = None) -> WorkerReadiness:
    """Count the live workers (heartbeat at most ``live_s`` s before ``now``) serving ``model`` (None: all)
    that are ready and starting."""
    return WorkerReadiness.of(list_live_workers(session, now=now, live_s=live_s), model=model)


def live_workers_by_model(session: Session, *, now: int, live_s: float) -> dict[str, WorkerReadiness]:
    """`WorkerReadiness` of the live workers of each model that has at least one."""
    live = list_live_workers(session, now=now, live_s=live_s)
    return {model: WorkerReadiness.of(live, model=model) for model in sorted({worker.model for worker in live})}


def ready_workers(session: Session, *, host: str, pids: list[int]) -> list[Worker]:
    """The ready workers among the processes ``pids`` of ``host`` (``batchinfer serve`` watching its children)."""
    query = select(Worker).where(Worker.host == host, Worker.pid.in_(pids), Worker.ready_s.is_not(None))
    return list(session.scalars(query))

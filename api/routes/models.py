"""``/v1/models``: the models this deployment serves (OpenAI Models API), so ``client.models.list()`` works.

Each is OpenAI's model object plus batchinfer's fields: ``kind`` (``generate`` or ``embed``),
``aliases`` (other names a line may use), ``dtype``, ``quantization`` and ``kv_cache_dtype`` (what its
workers run: docs/engine.md, "Quantized weights" and "Quantized KV cache"; the value its live workers report
when they agree, else the configured one; an embedding model's quantization is ``none`` (its weights are in its
dtype, as its workers report on ``/v1/workers``), its KV cache dtype null (it has no KV cache), and its dtype null
until a worker reports it),
``num_workers`` (live workers serving it: heartbeat within ``Settings.worker_live_s``) and
``num_ready_workers`` (those of them that take work; the rest are loading the model). A model with no
live worker is still listed: its batches wait (docs/operations.md, "Several models").
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import ReadSessionDep, SettingsDep
from jobs.config import ModelEntry
from jobs.errors import NotFound
from jobs.status import now_s
from jobs.workers import WorkerReadiness, live_workers_by_model

router = APIRouter(prefix="/v1/models", tags=["models"])

_STARTED_AT = now_s()  # `created`: when this API process started serving the models


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchinfer"
    kind: Literal["generate", "embed"] = "generate"
    aliases: list[str] = []
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    num_workers: int = 0
    num_ready_workers: int = 0

    @classmethod
    def of(cls, entry: ModelEntry, readiness: WorkerReadiness | None, *, dtype: str) -> ModelObject:
        """The configured ``entry`` (``dtype``: the deployment's) with the live workers serving it (None: none).
        Where those workers report one value of a field, that value is shown; none or several (a rolling
        change; ``/v1/workers`` shows each worker's), the configured one."""
        num_ready = readiness.num_ready if readiness else 0
        generate = entry.kind == "generate"

        def running(reported: tuple[str, ...], configured: str | None) -> str | None:
            return reported[0] if len(reported) == 1 else configured

        return cls(
            id=entry.name,
            created=_STARTED_AT,
            kind=entry.kind,
            aliases=entry.aliases,
            dtype=running(readiness.dtypes if readiness else (), dtype if generate else None),
            quantization=running(
                readiness.quantizations if readiness else (), entry.quantization if generate else "none"
            ),
            kv_cache_dtype=(
                running(readiness.kv_cache_dtypes if readiness else (), entry.kv_cache_dtype) if generate else None
            ),
            num_workers=num_ready + (readiness.num_starting if readiness else 0),
            num_ready_workers=num_ready,
        )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


@router.get("")
def list_models(session: ReadSessionDep, settings: SettingsDep) -> ModelList:
    """Every configured model, in the settings' order."""
    live = live_workers_by_model(session, now=now_s(), live_s=settings.worker_live_s)
    return ModelList(
        data=[ModelObject.of(entry, live.get(entry.name), dtype=settings.dtype) for entry in settings.models]
    )


@router.get("/{model_id}")
def retrieve_model(model_id: str, session: ReadSessionDep, settings: SettingsDep) -> ModelObject:
    """The configured model named ``model_id`` (or an alias of it); 404 ``model_not_found`` for any other id."""
    try:
        entry = settings.model_entry(model_id)
    except ValueError:
        raise NotFound("model", model_id) from None
    live = live_workers_by_model(session, now=now_s(), live_s=settings.worker_live_s)
    return ModelObject.of(entry, live.get(entry.name), dtype=settings.dtype)

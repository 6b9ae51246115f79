"""``/v1/models``: the one model this deployment serves (OpenAI Models API), so ``client.models.list()`` works."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import SettingsDep
from jobs.errors import NotFound
from jobs.status import now_s

router = APIRouter(prefix="/v1/models", tags=["models"])

_STARTED_AT = now_s()  # `created`: when this API process started serving the model


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchinfer"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


@router.get("")
def list_models(settings: SettingsDep) -> ModelList:
    return ModelList(data=[ModelObject(id=settings.served_model_name, created=_STARTED_AT)])


@router.get("/{model_id}")
def retrieve_model(model_id: str, settings: SettingsDep) -> ModelObject:
    """The served model; 404 ``model_not_found`` for any other id."""
    if model_id != settings.served_model_name:
        raise NotFound("model", model_id)
    return ModelObject(id=model_id, created=_STARTED_AT)

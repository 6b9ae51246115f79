"""``POST /v1/jobs``: upload a JSONL file and create its batch in one call (batchinfer's own shortcut).

Multipart fields: ``file`` (the JSONL), ``endpoint``, optional ``metadata`` (a JSON object of
strings, as a string) and ``completion_window`` (default "24h"). Returns the batch object, status
``validating``; validation then runs exactly as after ``POST /v1/batches``. Over the key's
enqueued-token limit (`api.quotas`) nothing is stored.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Form, UploadFile

from api.auth import OwnerDep
from api.deps import SessionDep, SettingsDep
from api.quotas import check_enqueued_tokens
from api.routes.batches import validate_in_background
from api.routes.files import store_upload
from jobs.errors import InvalidRequest
from jobs.repository import check_batch_params, create_batch
from jobs.schemas import COMPLETION_WINDOW, BatchObject

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _parse_metadata(raw: str | None) -> dict[str, str] | None:
    if raw is None or not raw.strip():
        return None
    try:
        metadata = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("metadata is nested too deeply to parse", param="metadata") from None
    except ValueError as exc:
        raise InvalidRequest(f"metadata is not valid JSON: {exc}", param="metadata") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidRequest("metadata must be a JSON object of string values", param="metadata")
    return metadata


@router.post("", response_model=BatchObject)
def create_job(
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    background_tasks: BackgroundTasks,
    file: UploadFile,
    endpoint: Annotated[str, Form()],
    metadata: Annotated[str | None, Form()] = None,
    completion_window: Annotated[str, Form()] = COMPLETION_WINDOW,
) -> BatchObject:
    parsed_metadata = _parse_metadata(metadata)
    check_batch_params(endpoint=endpoint, completion_window=completion_window, metadata=parsed_metadata)
    check_enqueued_tokens(
        session, owner=owner, input_file_bytes=file.size or 0, max_enqueued_tokens=settings.max_enqueued_tokens
    )
    stored = store_upload(session, settings, file, owner)
    batch = create_batch(
        session,
        input_file_id=stored.id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=parsed_metadata,
        owner=owner,
    )
    background_tasks.add_task(validate_in_background, batch.id, settings)
    return BatchObject.from_row(batch)

"""``/v1/files``: upload, list, retrieve, delete, and download content (OpenAI Files API).

An upload is copied from the multipart parser's spool into storage (`jobs.storage`) 1 MiB at a
time, counting bytes and lines on the way: over ``max_file_bytes`` or ``max_file_lines`` it is a 413
naming the limit, and nothing is kept. Content is streamed back from storage the same way. A file a
schedule runs cannot be deleted (a 409 ``file_in_use``) until that schedule is. Every
route sees only the files of the request's API key (`api.auth`); another key's file is a 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.errors import UploadTooLarge, too_large_message
from jobs.errors import Conflict, InvalidRequest, NotFound
from jobs.files import delete_file, file_chunks, get_file, list_files, read_chunks, write_file
from jobs.models import File
from jobs.repository import INPUT_PURPOSE
from jobs.schedules import schedules_using_file
from jobs.schemas import FileDeleted, FileObject, ListPage
from jobs.storage import FileTooLarge, storage_from_settings
from jobs.validation import TooManyLines, limit_lines

router = APIRouter(prefix="/v1/files", tags=["files"])


def store_upload(session: Session, settings: SettingsDep, upload: UploadFile, owner: str | None) -> File:
    """Write an uploaded batch input file (purpose "batch") owned by ``owner``, within the upload limits.

    Raises:
        UploadTooLarge: over ``settings.max_file_bytes`` (``file_too_large``) or ``settings.max_file_lines``
            non-blank lines (``too_many_lines``); nothing is stored.
    """
    try:
        return write_file(
            session,
            chunks=limit_lines(read_chunks(upload.file), settings.max_file_lines),
            filename=upload.filename or "upload.jsonl",
            purpose=INPUT_PURPOSE,
            storage=storage_from_settings(settings),
            max_bytes=settings.max_file_bytes,
            owner=owner,
        )
    except FileTooLarge:
        raise UploadTooLarge(too_large_message(settings.max_file_bytes), code="file_too_large") from None
    except TooManyLines:
        message = (
            f"the file has more than the limit of {settings.max_file_lines} requests "
            "(non-blank lines; BATCHINFER_MAX_FILE_LINES)"
        )
        raise UploadTooLarge(message, code="too_many_lines") from None


def _existing(session: Session, file_id: str, owner: str | None) -> File:
    file = get_file(session, file_id=file_id, owner=owner)
    if file is None:
        raise NotFound("file", file_id)
    return file


@router.post("", response_model=FileObject)
def create_file(
    session: SessionDep, settings: SettingsDep, owner: OwnerDep, file: UploadFile, purpose: Annotated[str, Form()]
) -> FileObject:
    """Upload a batch input file (multipart ``file`` + ``purpose="batch"``)."""
    if purpose != INPUT_PURPOSE:
        raise InvalidRequest(
            f"purpose must be 'batch' (this service only runs batches), got {purpose!r}", param="purpose"
        )
    return FileObject.from_row(store_upload(session, settings, file, owner))


@router.get("", response_model=ListPage[FileObject])
def list_all_files(
    session: ReadSessionDep,
    owner: OwnerDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> ListPage[FileObject]:
    """Files by creation time (newest first unless ``order=asc``), cursor-paged with ``after``."""
    files, has_more = list_files(session, purpose=purpose, after=after, limit=limit, order=order, owner=owner)
    data = [FileObject.from_row(file) for file in files]
    return ListPage[FileObject].of(data, has_more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(session: ReadSessionDep, owner: OwnerDep, file_id: str) -> FileObject:
    return FileObject.from_row(_existing(session, file_id, owner))


@router.delete("/{file_id}", response_model=FileDeleted)
def remove_file(session: SessionDep, settings: SettingsDep, owner: OwnerDep, file_id: str) -> FileDeleted:
    """Delete the file and its bytes; a file a schedule still runs is a 409 ``file_in_use`` naming the
    schedules (delete them first), since each of their ticks would otherwise create nothing."""
    file = _existing(session, file_id, owner)
    schedule_ids = schedules_using_file(session, file_id=file_id)
    if schedule_ids:
        raise Conflict(
            f"file {file_id!r} is the input file of schedule(s) {', '.join(schedule_ids)}; "
            "delete the schedule(s) first (DELETE /v1/schedules/{id})",
            code="file_in_use",
        )
    delete_file(session, file=file, storage=storage_from_settings(settings))
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content", response_class=StreamingResponse)
def file_content(session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep, file_id: str) -> StreamingResponse:
    """The file's raw bytes (JSONL for batch files), streamed from storage."""
    file = _existing(session, file_id, owner)
    chunks = file_chunks(file, storage=storage_from_settings(settings))
    try:
        first = next(chunks, b"")
    except FileNotFoundError:
        raise NotFound("file content", file_id) from None

    def body() -> Iterator[bytes]:
        yield first
        yield from chunks

    quoted = quote(file.filename)
    disposition = (
        f'attachment; filename="{file.filename}"'
        if quoted == file.filename
        else f"attachment; filename*=utf-8''{quoted}"
    )
    return StreamingResponse(
        body(),
        media_type="application/octet-stream",
        headers={"Content-Length": str(file.num_bytes), "Content-Disposition": disposition},
    )

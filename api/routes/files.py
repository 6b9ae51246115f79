"""``/v1/files``: upload, list, retrieve, delete, and download content (OpenAI Files API)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import FileResponse

from api.deps import SessionDep, SettingsDep
from jobs.errors import InvalidRequest, NotFound
from jobs.files import FileTooLarge, delete_file, file_path, get_file, list_files, read_chunks, write_file
from jobs.models import File
from jobs.repository import INPUT_PURPOSE
from jobs.schemas import FileDeleted, FileObject, ListPage

router = APIRouter(prefix="/v1/files", tags=["files"])


def store_upload(session: SessionDep, settings: SettingsDep, upload: UploadFile) -> File:
    """Write an uploaded batch input file (purpose "batch"), enforcing ``max_file_bytes``.

    Raises:
        InvalidRequest: the file is over ``settings.max_file_bytes`` (code ``file_too_large``).
    """
    try:
        return write_file(
            session,
            chunks=read_chunks(upload.file),
            filename=upload.filename or "upload.jsonl",
            purpose=INPUT_PURPOSE,
            files_dir=settings.files_dir,
            max_bytes=settings.max_file_bytes,
        )
    except FileTooLarge as exc:
        raise InvalidRequest(str(exc), param="file", code="file_too_large") from None


def _existing(session: SessionDep, file_id: str) -> File:
    file = get_file(session, file_id=file_id)
    if file is None:
        raise NotFound("file", file_id)
    return file


@router.post("", response_model=FileObject)
def create_file(
    session: SessionDep, settings: SettingsDep, file: UploadFile, purpose: Annotated[str, Form()]
) -> FileObject:
    """Upload a batch input file (multipart ``file`` + ``purpose="batch"``)."""
    if purpose != INPUT_PURPOSE:
        raise InvalidRequest(
            f"purpose must be 'batch' (this service only runs batches), got {purpose!r}", param="purpose"
        )
    return FileObject.from_row(store_upload(session, settings, file))


@router.get("", response_model=ListPage[FileObject])
def list_all_files(
    session: SessionDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> ListPage[FileObject]:
    """Files by creation time (newest first unless ``order=asc``), cursor-paged with ``after``."""
    files, has_more = list_files(session, purpose=purpose, after=after, limit=limit, order=order)
    data = [FileObject.from_row(file) for file in files]
    return ListPage[FileObject].of(data, has_more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(session: SessionDep, file_id: str) -> FileObject:
    return FileObject.from_row(_existing(session, file_id))


@router.delete("/{file_id}", response_model=FileDeleted)
def remove_file(session: SessionDep, settings: SettingsDep, file_id: str) -> FileDeleted:
    delete_file(session, file=_existing(session, file_id), files_dir=settings.files_dir)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content", response_class=FileResponse)
def file_content(session: SessionDep, settings: SettingsDep, file_id: str) -> FileResponse:
    """The file's raw bytes (JSONL for batch files)."""
    file = _existing(session, file_id)
    path = file_path(file, settings.files_dir)
    if not path.exists():
        raise NotFound("file content", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=file.filename)

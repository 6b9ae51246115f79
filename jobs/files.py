"""Files: metadata in the ``files`` table, bytes in a `jobs.storage.FileStorage` (local disk or the database).

`write_file` stores the bytes before the row is flushed; both belong to the caller's transaction, so
a rollback leaves neither behind (the local store removes its bytes on rollback). ``owner`` is the
API key that owns the file (`jobs.api_keys`); ``None`` in a lookup or a list means any owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.config import get_settings
from jobs.errors import InvalidRequest
from jobs.models import FILE_ID_PREFIX, File, new_id
from jobs.paging import keyset_page
from jobs.status import now_s
from jobs.storable_text import is_possible_id, is_storable, unstorable_reason
from jobs.storage import CHUNK_BYTES, FileStorage, storage_from_settings

MAX_FILENAME_CHARS = 255


def default_storage() -> FileStorage:
    """The store this process's settings name (`jobs.storage.storage_from_settings`)."""
    return storage_from_settings(get_settings())


def write_file(
    session: Session,
    *,
    chunks: Iterable[bytes],
    filename: str,
    purpose: str,
    storage: FileStorage | None = None,
    max_bytes: int | None = None,
    owner: str | None = None,
    now: int | None = None,
) -> File:
    """Store ``chunks`` as a new file and add its row to ``session`` (flushed, not committed).

    Args:
        storage: where the bytes go (default `default_storage()`).
        owner: the owning API key's id (None: no key).

    Raises:
        jobs.storage.FileTooLarge: more than ``max_bytes`` bytes arrived (nothing is kept).
        jobs.errors.InvalidRequest: ``filename`` holds a NUL character or a lone surrogate
            (``param="file"``; nothing is kept).
    """
    reason = unstorable_reason(filename)
    if reason is not None:
        raise InvalidRequest(f"the file name {reason}, which the service cannot store", param="file")
    storage = storage or default_storage()
    file_id = new_id(FILE_ID_PREFIX)
    num_bytes = storage.write(session, file_id, chunks, max_bytes=max_bytes)
    file = File(
        id=file_id,
        filename=(Path(filename).name or file_id)[:MAX_FILENAME_CHARS],
        purpose=purpose,
        num_bytes=num_bytes,
        created_at=now_s() if now is None else now,
        storage_path=file_id,
        owner_key_id=owner,
    )
    session.add(file)
    session.flush()
    return file


def read_chunks(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Chunks of a binary stream (anything with ``read(n) -> bytes``) until EOF."""
    while chunk := stream.read(chunk_bytes):
        yield chunk


def file_chunks(file: File, *, storage: FileStorage | None = None, session: Session | None = None) -> Iterator[bytes]:
    """``file``'s bytes in chunks of at most 1 MiB (``session``: read in that transaction).

    Raises:
        FileNotFoundError: its bytes are gone (raised by the first ``next``).
    """
    return (storage or default_storage()).read(file.storage_path, session=session)


def get_file(session: Session, *, file_id: str, owner: str | None = None) -> File | None:
    """The file ``file_id`` (None when there is none, or when ``owner`` is given and it owns it not)."""
    if not is_possible_id(file_id):
        return None
    file = session.get(File, file_id)
    if file is None or (owner is not None and file.owner_key_id != owner):
        return None
    return file


def list_files(
    session: Session,
    *,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 10_000,
    order: str = "desc",
    owner: str | None = None,
) -> tuple[list[File], bool]:
    """A page of files by creation time (``order`` "desc" = newest first), optionally of one purpose
    and one ``owner``.

    Returns ``(files, has_more)``; none for a ``purpose`` no file can have (`jobs.storable_text`).
    Raises `UnknownCursor` when ``after`` names no file (of ``owner``).
    """
    if purpose is not None and not is_storable(purpose):
        return [], False
    query = select(File)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if owner is not None:
        query = query.where(File.owner_key_id == owner)
    return keyset_page(session, query, File, after=after, limit=limit, descending=order == "desc", owner=owner)


def delete_file(session: Session, *, file: File, storage: FileStorage | None = None) -> None:
    """Remove ``file``'s row and its bytes (missing bytes are ignored)."""
    session.delete(file)
    session.flush()
    (storage or default_storage()).delete(session, file.storage_path)

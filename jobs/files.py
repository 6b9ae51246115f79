"""A small file store: bytes on disk under ``files_dir`` (one file per id), metadata in the ``files`` table.

Bytes are written to a temporary name and renamed into place, so a reader never sees a partial
file. The bytes land on disk before the caller's transaction commits; a rolled-back transaction
leaves an orphan file behind (harmless: nothing references it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.models import FILE_ID_PREFIX, File, new_id
from jobs.paging import keyset_page
from jobs.status import now_s

CHUNK_BYTES = 1 << 20
MAX_FILENAME_CHARS = 255


class FileTooLarge(ValueError):
    """An upload went over ``max_bytes``; ``.max_bytes`` is the limit."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the file is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


def write_file(
    session: Session,
    *,
    chunks: Iterable[bytes],
    filename: str,
    purpose: str,
    files_dir: Path,
    max_bytes: int | None = None,
    now: int | None = None,
) -> File:
    """Store ``chunks`` as a new file and add its row to ``session`` (flushed, not committed).

    Raises:
        FileTooLarge: more than ``max_bytes`` bytes arrived (nothing is kept).
    """
    file_id = new_id(FILE_ID_PREFIX)
    files_dir.mkdir(parents=True, exist_ok=True)
    final_path = files_dir / file_id
    partial_path = files_dir / f".{file_id}.partial"
    num_bytes = 0
    try:
        with partial_path.open("wb") as out:
            for chunk in chunks:
                num_bytes += len(chunk)
                if max_bytes is not None and num_bytes > max_bytes:
                    raise FileTooLarge(max_bytes)
                out.write(chunk)
        os.replace(partial_path, final_path)
    finally:
        partial_path.unlink(missing_ok=True)
    file = File(
        id=file_id,
        filename=(Path(filename).name or file_id)[:MAX_FILENAME_CHARS],
        purpose=purpose,
        num_bytes=num_bytes,
        created_at=now_s() if now is None else now,
        storage_path=file_id,
    )
    session.add(file)
    session.flush()
    return file


def read_chunks(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterable[bytes]:
    """Chunks of a binary stream (anything with ``read(n) -> bytes``) until EOF."""
    while chunk := stream.read(chunk_bytes):
        yield chunk


def file_path(file: File, files_dir: Path) -> Path:
    """Where ``file``'s bytes live on disk."""
    return files_dir / file.storage_path


def get_file(session: Session, *, file_id: str) -> File | None:
    return session.get(File, file_id)


def list_files(
    session: Session, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000, order: str = "desc"
) -> tuple[list[File], bool]:
    """A page of files by creation time (``order`` "desc" = newest first), optionally of one purpose.

    Returns ``(files, has_more)``. Raises `UnknownCursor` when ``after`` names no file.
    """
    query = select(File)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return keyset_page(session, query, File, after=after, limit=limit, descending=order == "desc")


def delete_file(session: Session, *, file: File, files_dir: Path) -> None:
    """Remove ``file``'s row and its bytes (a missing bytes file is ignored)."""
    session.delete(file)
    session.flush()
    file_path(file, files_dir).unlink(missing_ok=True)

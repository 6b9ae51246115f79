"""Where file bytes live: the API's local disk (the zero-setup default) or the database (shared by every host).

Both stores stream: bytes go in and come out as chunks of at most `CHUNK_BYTES`, so a 200 MB file
never sits in memory. A file is found by its key (the ``files.storage_path`` column, the file's id).

| ``BATCHINFER_FILE_STORAGE`` | store | bytes live in | who can read them |
|---|---|---|---|
| ``local`` (default) | `LocalStorage` | ``files_dir``, one file per key | processes on this host |
| ``database`` | `DatabaseStorage` | the ``file_chunks`` table, one row per chunk | every process on the database |

Writes are all or nothing. `LocalStorage` writes to a temporary name and renames it into place, and
removes it again when the caller's transaction rolls back (`remove_on_rollback`); `DatabaseStorage`
inserts its rows in the caller's transaction, so a rollback takes them away with everything else.
Design: docs/architecture.md, "Files".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from sqlalchemy import delete, event, insert, select
from sqlalchemy.orm import Session

from jobs.config import Settings
from jobs.db import session_scope
from jobs.models import File, FileChunk

CHUNK_BYTES = 1 << 20
"""Largest chunk a store reads or writes at once (1 MiB)."""


class FileTooLarge(ValueError):
    """A write went over ``max_bytes``; ``.max_bytes`` is the limit. Nothing was kept."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the file is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


class FileStorage(Protocol):
    """A store of file bytes by key."""

    def write(self, session: Session, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        """Store ``chunks`` under ``key`` as part of ``session``'s transaction; returns the byte count.

        Raises:
            FileTooLarge: more than ``max_bytes`` bytes arrived (nothing is kept).
        """
        ...

    def read(self, key: str, *, session: Session | None = None) -> Iterator[bytes]:
        """The bytes under ``key`` in chunks of at most `CHUNK_BYTES`.

        ``session``: read inside this transaction (else in short read-only transactions of their own,
        `jobs.db.session_scope` with ``read_only``, which take no lock even while the caller holds one:
        for a stream that outlives the request's session).

        Raises:
            FileNotFoundError: nothing is stored under ``key`` (raised by the first ``next``).
        """
        ...

    def delete(self, session: Session, key: str) -> None:
        """Remove ``key``'s bytes (missing bytes are ignored)."""
        ...


def rechunk(chunks: Iterable[bytes], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``chunks`` regrouped into pieces of exactly ``size`` bytes (the last one shorter, never empty)."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


def _counted(chunks: Iterable[bytes], max_bytes: int | None) -> Iterator[bytes]:
    num_bytes = 0
    for chunk in chunks:
        num_bytes += len(chunk)
        if max_bytes is not None and num_bytes > max_bytes:
            raise FileTooLarge(max_bytes)
        yield chunk


_ROLLBACK_PATHS = "batchinfer_remove_on_rollback"


def remove_on_rollback(session: Session, path: Path) -> None:
    """Unlink ``path`` if ``session``'s transaction rolls back instead of committing."""
    paths: list[Path] | None = session.info.get(_ROLLBACK_PATHS)
    if paths is None:
        paths = session.info[_ROLLBACK_PATHS] = []

        @event.listens_for(session, "after_commit")
        def _committed(_session: Session) -> None:
            session.info[_ROLLBACK_PATHS].clear()

        @event.listens_for(session, "after_soft_rollback")
        def _rolled_back(_session: Session, _previous: object) -> None:
            for stale in session.info[_ROLLBACK_PATHS]:
                stale.unlink(missing_ok=True)
            session.info[_ROLLBACK_PATHS].clear()

    paths.append(path)


class LocalStorage:
    """Bytes on this host's disk: ``files_dir / key``."""

    def __init__(self, files_dir: Path) -> None:
        self.files_dir = files_dir

    def path(self, key: str) -> Path:
        return self.files_dir / key

    def write(self, session: Session, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        final_path, partial_path = self.path(key), self.files_dir / f".{key}.partial"
        num_bytes = 0
        try:
            with partial_path.open("wb") as out:
                for chunk in _counted(chunks, max_bytes):
                    out.write(chunk)
                    num_bytes += len(chunk)
            os.replace(partial_path, final_path)
        finally:
            partial_path.unlink(missing_ok=True)
        remove_on_rollback(session, final_path)
        return num_bytes

    def read(self, key: str, *, session: Session | None = None) -> Iterator[bytes]:
        with self.path(key).open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    def delete(self, session: Session, key: str) -> None:
        self.path(key).unlink(missing_ok=True)


class DatabaseStorage:
    """Bytes in the database's ``file_chunks`` table: rows ``(file_id, seq, data)`` of `CHUNK_BYTES` each.

    PostgreSQL stores ``data`` as ``bytea`` (TOAST-compressed out of line), SQLite as a BLOB. Each
    chunk is inserted on its own, so a write holds one chunk in memory; a read fetches one row per query.
    """

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def write(self, session: Session, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> int:
        num_bytes = 0
        for seq, chunk in enumerate(rechunk(_counted(chunks, max_bytes))):
            session.execute(insert(FileChunk).values(file_id=key, seq=seq, data=chunk))
            num_bytes += len(chunk)
        return num_bytes

    def read(self, key: str, *, session: Session | None = None) -> Iterator[bytes]:
        seq = 0
        while True:
            query = select(FileChunk.data).where(FileChunk.file_id == key, FileChunk.seq == seq)
            if session is not None:
                chunk = session.scalar(query)
            else:
                with session_scope(self.database_url, read_only=True) as own:
                    chunk = own.scalar(query)
            if chunk is None:
                if seq == 0 and not self._exists(key, session):
                    raise FileNotFoundError(key)
                return
            yield chunk
            seq += 1

    def _exists(self, key: str, session: Session | None) -> bool:
        # NOTE: an empty file has no chunk; only its files row tells it from a missing one.
        query = select(File.id).where(File.storage_path == key)
        if session is not None:
            return session.scalar(query) is not None
        with session_scope(self.database_url, read_only=True) as own:
            return own.scalar(query) is not None

    def delete(self, session: Session, key: str) -> None:
        session.execute(delete(FileChunk).where(FileChunk.file_id == key))


STORAGE_KINDS = ("local", "database")


def storage_from_settings(settings: Settings) -> FileStorage:
    """The store ``settings.file_storage`` names (``local``: ``settings.files_dir``; ``database``)."""
    if settings.file_storage == "database":
        return DatabaseStorage(settings.database_url)
    return LocalStorage(settings.files_dir)

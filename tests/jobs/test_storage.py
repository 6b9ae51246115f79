"""File stores (jobs/storage.py): local disk and database chunks, on SQLite and PostgreSQL.

Bytes round-trip through `write_file` / `file_chunks` in pieces of at most 1 MiB; a rolled-back
transaction or a write over the limit leaves nothing behind; deleting removes the bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from jobs.config import Settings
from jobs.db import session_scope
from jobs.files import delete_file, file_chunks, get_file, write_file
from jobs.models import FileChunk
from jobs.storage import CHUNK_BYTES, DatabaseStorage, FileStorage, FileTooLarge, LocalStorage, rechunk
from tests.helpers.service import postgres_url, service_settings  # noqa: F401


@pytest.fixture(params=["local", "database"])
def storage(request: pytest.FixtureRequest, service_settings: Settings) -> FileStorage:
    if request.param == "local":
        return LocalStorage(service_settings.files_dir)
    return DatabaseStorage(service_settings.database_url)


def _stored_pieces(storage: FileStorage, settings: Settings) -> int:
    """Chunk rows (database) or files (disk) the store holds now."""
    if isinstance(storage, DatabaseStorage):
        with session_scope() as session:
            return session.scalar(select(func.count()).select_from(FileChunk)) or 0
    return len(list(settings.files_dir.iterdir())) if settings.files_dir.exists() else 0


def test_bytes_round_trip_in_bounded_chunks(storage: FileStorage, service_settings: Settings) -> None:
    data = bytes(range(256)) * ((2 * CHUNK_BYTES + 1000) // 256)
    pieces = [data[i : i + 70_000] for i in range(0, len(data), 70_000)]
    with session_scope() as session:
        file = write_file(session, chunks=pieces, filename="in.jsonl", purpose="batch", storage=storage)
    assert file.num_bytes == len(data)
    with session_scope() as session:
        stored = get_file(session, file_id=file.id)
    assert stored is not None
    chunks = list(file_chunks(stored, storage=storage))  # short transactions of its own
    assert b"".join(chunks) == data and max(len(c) for c in chunks) <= CHUNK_BYTES
    with session_scope() as session:
        assert b"".join(file_chunks(stored, storage=storage, session=session)) == data
        delete_file(session, file=stored, storage=storage)
    assert _stored_pieces(storage, service_settings) == 0


def test_an_empty_file_reads_empty_and_missing_bytes_raise(storage: FileStorage) -> None:
    with session_scope() as session:
        file = write_file(session, chunks=[], filename="e.jsonl", purpose="batch", storage=storage)
        assert list(file_chunks(file, storage=storage, session=session)) == []
    with pytest.raises(FileNotFoundError):
        next(storage.read("file-missing"))


def test_a_rolled_back_write_leaves_nothing(storage: FileStorage, service_settings: Settings) -> None:
    with pytest.raises(RuntimeError), session_scope() as session:
        write_file(session, chunks=[b"x" * 5000], filename="in.jsonl", purpose="batch", storage=storage)
        raise RuntimeError("the request failed after the bytes were stored")
    assert _stored_pieces(storage, service_settings) == 0


def test_a_write_over_the_limit_keeps_nothing(storage: FileStorage, service_settings: Settings) -> None:
    with pytest.raises(FileTooLarge), session_scope() as session:
        write_file(
            session,
            chunks=[b"x" * 600, b"y" * 600],
            filename="in.jsonl",
            purpose="batch",
            storage=storage,
            max_bytes=1000,
        )
    assert _stored_pieces(storage, service_settings) == 0


def test_rechunk_cuts_exact_pieces() -> None:
    assert list(rechunk([b"abc", b"", b"defgh", b"i"], size=4)) == [b"abcd", b"efgh", b"i"]
    assert list(rechunk([], size=4)) == []


def test_local_files_are_not_leftover_partials(service_settings: Settings, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "files")
    with session_scope() as session:
        write_file(session, chunks=[b"a\n"], filename="in.jsonl", purpose="batch", storage=storage)
    assert [p.name.startswith("file-") for p in (tmp_path / "files").iterdir()] == [True]

"""Engine/session factories and programmatic migrations."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, select

from jobs.db import dispose_engines, get_engine, session_scope, upgrade_database
from jobs.models import File


def test_upgrade_database_works_from_any_cwd_and_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'nested' / 'dir' / 'db.sqlite'}"
    try:
        upgrade_database(url)
        upgrade_database(url)
        tables = set(inspect(get_engine(url)).get_table_names())
        assert {"files", "batches", "batch_requests", "alembic_version"} <= tables
    finally:
        dispose_engines()


def test_session_scope_commits_or_rolls_back(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_database(url)
    row = {"filename": "f", "purpose": "batch", "num_bytes": 1, "created_at": 1, "storage_path": "x"}
    try:
        with session_scope(url) as session:
            session.add(File(id="file-kept", **row))
        with pytest.raises(RuntimeError), session_scope(url) as session:
            session.add(File(id="file-dropped", **row))
            session.flush()
            raise RuntimeError("boom")
        with session_scope(url) as session:
            assert list(session.scalars(select(File.id))) == ["file-kept"]
    finally:
        dispose_engines()

"""Settings: defaults derive from ``data_dir``; env vars with the ``BATCHINFER_`` prefix override."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.config import BUILTIN_MODEL, Settings


def test_defaults_live_under_absolute_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("DATABASE_URL", "BROKER_URL", "FILES_DIR", "MAX_FILE_LINES", "MAX_FILE_BYTES"):
        monkeypatch.delenv(f"BATCHINFER_{name}", raising=False)
    settings = Settings(data_dir=Path("rel"))
    assert settings.data_dir == tmp_path / "rel"
    assert settings.database_url == f"sqlite:///{tmp_path / 'rel' / 'batchinfer.db'}"
    assert settings.broker_url == f"sqla+sqlite:///{tmp_path / 'rel' / 'broker.db'}"
    assert settings.files_dir == tmp_path / "rel" / "files"
    assert settings.max_file_lines == 50_000
    assert settings.max_file_bytes == 200_000_000


def test_env_overrides_and_postgres_driver_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", "postgresql://u@db:5432/batchinfer")
    monkeypatch.setenv("BATCHINFER_BROKER_URL", "redis://redis:6379/0")
    monkeypatch.setenv("BATCHINFER_MAX_FILE_LINES", "7")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://u@db:5432/batchinfer"
    assert settings.broker_url == "redis://redis:6379/0"
    assert settings.max_file_lines == 7


def test_served_model_name_is_builtin_name_or_folder_basename(tmp_path: Path) -> None:
    assert Settings().served_model_name == BUILTIN_MODEL
    folder = tmp_path / "my-llama"
    folder.mkdir()
    assert Settings(model=str(folder)).served_model_name == "my-llama"


def test_a_worker_is_judged_dead_only_after_missing_two_heartbeats(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, worker_heartbeat_s=5, worker_dead_s=10)
    assert settings.worker_dead_s == 10
    with pytest.raises(ValueError, match="worker_dead_s"):
        Settings(data_dir=tmp_path, worker_heartbeat_s=5, worker_dead_s=9)

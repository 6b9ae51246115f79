"""Settings: defaults derive from ``data_dir``; env vars with the ``BATCHINFER_`` prefix override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, ModelEntry, Settings


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


def test_default_models_are_the_model_setting_and_the_builtin_embedder(tmp_path: Path) -> None:
    folder = tmp_path / "my-llama"
    folder.mkdir()
    settings = Settings(model=str(folder), quantization="int8")
    assert settings.models == [
        ModelEntry(name="my-llama", source=str(folder), quantization="int8", kv_cache_dtype="auto"),
        ModelEntry(name=BUILTIN_EMBEDDING_MODEL, source=BUILTIN_EMBEDDING_MODEL, kind="embed"),
    ]
    assert (settings.served_model_name, settings.model, settings.quantization) == ("my-llama", str(folder), "int8")


def test_model_naming_the_builtin_embedder_makes_it_the_one_model(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, model=BUILTIN_EMBEDDING_MODEL)
    assert settings.models == [ModelEntry(name=BUILTIN_EMBEDDING_MODEL, source=BUILTIN_EMBEDDING_MODEL, kind="embed")]
    assert settings.served_model_name == BUILTIN_EMBEDDING_MODEL


def test_models_from_env_as_an_object_or_a_list_with_aliases_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    models = {"chat": BUILTIN_MODEL, "mini": {"source": "/m/tiny", "aliases": ["small"], "quantization": "int8"}}
    monkeypatch.setenv("BATCHINFER_MODELS", json.dumps(models))
    settings = Settings()
    assert [(m.name, m.source, m.kind) for m in settings.models] == [
        ("chat", BUILTIN_MODEL, "generate"),
        ("mini", "/m/tiny", "generate"),
    ]
    assert settings.aliases == {"chat": "chat", "mini": "mini", "small": "mini"}
    assert (settings.served_model_name, settings.model, settings.quantization) == ("chat", BUILTIN_MODEL, "none")
    as_list = [{"name": "e", "source": BUILTIN_EMBEDDING_MODEL, "kind": "embed"}, {"name": "g", "source": "x"}]
    monkeypatch.setenv("BATCHINFER_MODELS", json.dumps(as_list))
    assert [m.kind for m in Settings().models] == ["embed", "generate"]


def test_worker_model_makes_the_process_serve_that_model(monkeypatch: pytest.MonkeyPatch) -> None:
    models = {"chat": BUILTIN_MODEL, "mini": {"source": "/m/tiny", "aliases": ["small"], "quantization": "int8"}}
    monkeypatch.setenv("BATCHINFER_MODELS", json.dumps(models))
    monkeypatch.setenv("BATCHINFER_WORKER_MODEL", "small")
    settings = Settings()
    assert (settings.served_model_name, settings.model, settings.quantization) == ("mini", "/m/tiny", "int8")
    monkeypatch.setenv("BATCHINFER_WORKER_MODEL", "gpt-4o")
    with pytest.raises(ValidationError, match=r"no model 'gpt-4o' is configured.*chat, mini"):
        Settings()


def test_each_model_gets_its_own_or_the_deployments_quantization_and_kv_cache_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/operations.md, "Several models": a model-list entry's ``quantization`` / ``kv_cache_dtype`` beat the
    deployment's settings; an entry without them gets the deployment's (not the first model's), and vLLM's
    ``fp8`` is stored as ``fp8_e4m3``."""
    models = {
        "chat": {"source": BUILTIN_MODEL, "quantization": "q4", "kv_cache_dtype": "fp8"},
        "mini": {"source": "/m/tiny", "kv_cache_dtype": "int8"},
        "plain": "/m/plain",
    }
    monkeypatch.setenv("BATCHINFER_MODELS", json.dumps(models))
    monkeypatch.setenv("BATCHINFER_QUANTIZATION", "int8")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_DTYPE", "int4")
    settings = Settings()  # the API's view: every entry filled in
    assert [(m.name, m.quantization, m.kv_cache_dtype) for m in settings.models] == [
        ("chat", "q4", "fp8_e4m3"),
        ("mini", "int8", "int8"),
        ("plain", "int8", "int4"),
    ]
    served = {}
    for name in models:
        monkeypatch.setenv("BATCHINFER_WORKER_MODEL", name)
        worker = Settings()  # a worker's view: the deployment-wide fields are its model's
        served[name] = (worker.quantization, worker.kv_cache_dtype)
    assert served == {"chat": ("q4", "fp8_e4m3"), "mini": ("int8", "int8"), "plain": ("int8", "int4")}


@pytest.mark.parametrize(
    "models",
    [
        {"a": "x", "b": {"source": "y", "aliases": ["a"]}},
        {"a": {"source": "x", "aliases": ["a"]}},
        {"a": {"source": "x", "kind": "classify"}},
        {"a": {"source": "x", "quantization": "q3"}},
        {"a": {"source": "x", "kv_cache_dtype": "int2"}},
        {"a": {"source": "x", "kv_cache_dtyp": "int8"}},  # a misspelt key is refused, not ignored
        {"a": {"source": "x", "kind": "embed", "kv_cache_dtype": "int8"}},  # an embedder has no KV cache
        {"a": {"source": "x", "kind": "embed", "quantization": "int8"}},  # nor quantized weights
    ],
)
def test_bad_model_lists_are_refused(monkeypatch: pytest.MonkeyPatch, models: dict[str, object]) -> None:
    monkeypatch.setenv("BATCHINFER_MODELS", json.dumps(models))
    with pytest.raises(ValidationError):
        Settings()


def test_a_worker_is_judged_dead_only_after_missing_two_heartbeats(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, worker_heartbeat_s=5, worker_dead_s=10)
    assert settings.worker_dead_s == 10
    with pytest.raises(ValueError, match="worker_dead_s"):
        Settings(data_dir=tmp_path, worker_heartbeat_s=5, worker_dead_s=9)

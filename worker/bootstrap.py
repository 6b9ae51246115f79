"""One engine per worker process, built lazily from the service settings.

The first task a worker process runs pays for model preparation and engine start-up; every later
task reuses the same `LLMEngine` (weights and KV cache stay resident). An embedding model (an encoder:
`worker.engine.executor.models.registry.model_kind_of`) gets a `PoolingEngine` instead. The engine is warmed up once
at start (:func:`warm_up_engine`), so a job's first batch runs at the warm speed. Celery runs the worker with
``--pool=solo`` so the process that builds the engine is the one that runs the tasks (forking after
torch has started threads hangs the prefork pool).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.config import Settings, get_settings
from worker.cpu_threads import available_cpus, use_bounded_wait

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.pooling_engine import PoolingEngine

logger = logging.getLogger(__name__)

_engine: LLMEngine | PoolingEngine | None = None
_lock = threading.Lock()

SERVED_KINDS = frozenset({"generate", "embed"})
"""Model kinds (`jobs.config.ModelEntry.kind`) this build has an engine for; ``batchinfer serve`` starts
workers for these only."""

WARMUP_PROMPT_LENS = (16, 128)  # one short and one longer prompt, prefilled together, then decoded as a batch
WARMUP_MAX_TOKENS = 4
# NOTE: an embedding forward packs whole inputs; about 4096 tokens keeps the GEMMs efficient and their
# activations cache-resident (8192 measured 5-10% slower per FLOP on Zen 4: docs/engine.md, "Embeddings").
EMBEDDING_MIN_BATCHED_TOKENS = 4096


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is visible, else ``"cpu"``; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def num_torch_threads(settings: Settings) -> int:
    """``settings.torch_num_threads``, or the cores this process is given (affinity and cgroup quota,
    :func:`worker.cpu_threads.available_cpus`)."""
    if settings.torch_num_threads is not None:
        return settings.torch_num_threads
    return available_cpus()


def prepared_weights_dir(settings: Settings) -> Path:
    """Where the engine caches what it prepares from a model folder: packed weights, resolved config and tokenizer class."""
    return settings.model_cache_dir / "prepared"


def engine_config(settings: Settings) -> EngineConfig:
    """The `EngineConfig` the settings ask for; prepares (converts, once) the served model's folder.

    Raises:
        worker.model_prepare.ModelNotFoundError: ``settings.model`` is neither built in nor a folder.
    """
    from worker.engine.config import EngineConfig
    from worker.model_prepare import prepare_model

    model_dir = prepare_model(settings.model, settings.model_cache_dir)
    return EngineConfig(
        model=str(model_dir),
        dtype=settings.dtype,
        device=resolve_device(settings.device),
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        block_size=settings.block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        enable_prefix_caching=settings.enable_prefix_caching,
        speculative_mode=settings.speculative_mode,
        speculative_method=settings.speculative_method,
        num_speculative_tokens=settings.num_speculative_tokens,
        speculative_disable_by_batch_size=settings.speculative_disable_by_batch_size,
        speculative_tree_width=settings.speculative_tree_width,
        quantization=settings.quantization,
        prepared_weights_dir=str(prepared_weights_dir(settings)),
        kv_cache_dtype=settings.kv_cache_dtype,
    )


class KindNotServed(RuntimeError):
    """The model this process is to serve is of a kind no engine of this build serves (`SERVED_KINDS`)."""


def check_served_kind(settings: Settings) -> None:
    """Raise `KindNotServed` when the model ``settings`` serve (``worker_model``) is of a kind without an engine."""
    entry = settings.model_entry(settings.served_model_name)
    if entry.kind not in SERVED_KINDS:
        raise KindNotServed(
            f"model {entry.name!r} is of kind {entry.kind!r}, which is not yet served "
            f"(served kinds: {', '.join(sorted(SERVED_KINDS))})"
        )


def get_engine() -> LLMEngine | PoolingEngine:
    """This process's engine, built on first use (thread-safe): a `PoolingEngine` for an embedding model.

    Raises:
        KindNotServed: the served model's kind has no engine yet (`check_served_kind`).
        ValueError: the engine refused its settings: a model it cannot find or load
            (`worker.model_prepare.ModelNotFoundError`, a corrupt GGUF), a quantization the dtype cannot run, a KV
            cache too small for one sequence. Deterministic: the same settings fail the same way (``batchinfer
            worker`` exits with `worker.cli.CONFIG_REFUSED_EXIT`, which ``serve`` does not restart).
    """
    global _engine
    with _lock:
        if _engine is None:
            use_bounded_wait()  # before torch loads libgomp (a no-op for this process if it already has)
            import torch

            from worker.engine.llm_engine import LLMEngine

            settings = get_settings()
            check_served_kind(settings)
            torch.set_num_threads(num_torch_threads(settings))
            embedding_engine = _embedding_engine(settings)
            if embedding_engine is not None:
                _engine = embedding_engine
                return _engine
            config = engine_config(settings)
            logger.info("starting engine: %s (torch threads: %d)", config, torch.get_num_threads())
            engine = LLMEngine(config)
            warm_up_engine(engine)
            _engine = engine
        return _engine


def _embedding_engine(settings: Settings) -> PoolingEngine | None:
    """A warmed-up `PoolingEngine` when the served model is an embedding model (an encoder, or a decoder the
    model list marks ``embed``: last-token pooling), else None."""
    model_dir = _prepared_model(settings)
    if _model_kind(model_dir, settings) != "embed":
        return None  # NOTE: before importing the pooling engine (transformers' auto mappings: 0.3 CPU-s)
    from worker.engine.pooling_engine import EmbeddingEngineConfig, PoolingEngine

    config = EmbeddingEngineConfig(
        str(model_dir),
        dtype=settings.dtype,
        device=resolve_device(settings.device),
        max_num_batched_tokens=max(settings.max_num_batched_tokens, EMBEDDING_MIN_BATCHED_TOKENS),
        matmul_dtype=settings.embedding_matmul_dtype,
    )
    logger.info("starting embedding engine: %s", config)
    start_s = time.perf_counter()
    engine = PoolingEngine(config)
    vocab_size = int(engine.model_config.vocab_size)
    engine.embed(
        [[(i * 7 + 1) % vocab_size for i in range(min(length, engine.max_model_len))] for length in WARMUP_PROMPT_LENS]
    )
    logger.info("embedding engine warmed up in %.2f s", time.perf_counter() - start_s)
    return engine


def _prepared_model(settings: Settings) -> Path:
    from worker.model_prepare import prepare_model

    return prepare_model(settings.model, settings.model_cache_dir)


def _model_kind(model_dir: Path, settings: Settings) -> str:
    """The served model's kind: ``embed`` where the model list marks it so (a decoder as embedder), else the
    kind of the folder's architecture."""
    if settings.model_entry(settings.served_model_name).kind == "embed":
        return "embed"
    from worker.engine.executor.models.registry import model_kind_of
    from worker.engine.model_files import load_config

    return model_kind_of(load_config(model_dir, prepared_weights_dir(settings)))


def warm_up_engine(engine: LLMEngine) -> None:
    """Run a short greedy generate so the first job's first steps do not pay one-off start-up costs.

    The first forward passes of a fresh process are slow (lazily initialised kernels and thread pools,
    first-touch page faults on the KV cache and on freshly packed weights). The whole KV cache is faulted in first
    (:meth:`LLMEngine.populate_kv_cache`: about 0.3-2 s per GiB here, once, against a few percent of the first jobs'
    steps; docs/engine.md, "KV cache memory"). Two prompts of
    :data:`WARMUP_PROMPT_LENS` tokens (clipped to the context) are prefilled in one step and decoded as a
    batch for :data:`WARMUP_MAX_TOKENS` tokens, through the same paths a job takes. The engine's statistics
    window is then reset (:meth:`LLMEngine.make_stats`), so metrics report jobs only.
    """
    from worker.engine.sampling_params import SamplingParams

    start_s = time.perf_counter()
    engine.populate_kv_cache()
    vocab_size = int(engine.model_config.vocab_size)
    room = engine.max_model_len - WARMUP_MAX_TOKENS
    prompts: list[str | list[int]] = [
        [(i * 7 + 1) % vocab_size for i in range(min(length, room))] for length in WARMUP_PROMPT_LENS
    ]
    params = SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    engine.make_stats()
    logger.info("engine warmed up in %.2f s", time.perf_counter() - start_s)

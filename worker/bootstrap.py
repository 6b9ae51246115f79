"""One engine per worker process, built lazily from the service settings.

The first task a worker process runs pays for model preparation and engine start-up; every later
task reuses the same `LLMEngine` (weights and KV cache stay resident). Celery runs the worker with
``--pool=solo`` so the process that builds the engine is the one that runs the tasks (forking after
torch has started threads hangs the prefork pool).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from jobs.config import Settings, get_settings

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_engine: LLMEngine | None = None
_lock = threading.Lock()


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is visible, else ``"cpu"``; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def num_torch_threads(settings: Settings) -> int:
    """``settings.torch_num_threads``, or every core this process may run on."""
    if settings.torch_num_threads is not None:
        return settings.torch_num_threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
    )


def get_engine() -> LLMEngine:
    """This process's engine, built on first use (thread-safe)."""
    global _engine
    with _lock:
        if _engine is None:
            import torch

            from worker.engine.llm_engine import LLMEngine

            settings = get_settings()
            torch.set_num_threads(num_torch_threads(settings))
            config = engine_config(settings)
            logger.info("starting engine: %s (torch threads: %d)", config, torch.get_num_threads())
            _engine = LLMEngine(config)
        return _engine

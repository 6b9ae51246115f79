"""batchinfer's inference engine: paged KV cache, continuous batching, our own Llama (vLLM's design).

Importing this package does not import torch; :class:`LLMEngine` loads it on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.engine.config import EngineConfig
from worker.engine.errors import PromptTooLongError
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.llm_engine import LLMEngine

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "PromptTooLongError", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from worker.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

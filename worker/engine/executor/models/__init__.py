"""Model implementations over a flat ragged batch with a paged KV cache."""

from worker.engine.executor.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]

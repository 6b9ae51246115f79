"""Model implementations over a flat ragged batch with a paged KV cache."""

from worker.engine.executor.models.gemma2 import Gemma2ForCausalLM
from worker.engine.executor.models.gemma3 import Gemma3ForCausalLM
from worker.engine.executor.models.llama import LlamaForCausalLM
from worker.engine.executor.models.phi3 import Phi3ForCausalLM
from worker.engine.executor.models.qwen2 import Qwen2ForCausalLM
from worker.engine.executor.models.qwen3 import Qwen3ForCausalLM
from worker.engine.executor.models.registry import MODEL_ARCHITECTURES, UnsupportedModelError, resolve_model_class

__all__ = [
    "MODEL_ARCHITECTURES",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "UnsupportedModelError",
    "resolve_model_class",
]

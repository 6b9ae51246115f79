"""Which model class serves which checkpoint: ``config.json``'s ``architectures`` -> implementation.

As vLLM's model registry: the architecture name Hugging Face writes into ``config.json`` picks the
class. Mistral is Llama with a sliding window; it reuses :class:`LlamaForCausalLM` as is, and
:func:`check_supported` refuses a window the engine would have to apply (no sliding-window attention
yet) rather than silently computing full attention.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.engine.executor.models.gemma3 import Gemma3ForCausalLM
from worker.engine.executor.models.llama import LlamaForCausalLM
from worker.engine.executor.models.phi3 import Phi3ForCausalLM
from worker.engine.executor.models.qwen2 import Qwen2ForCausalLM
from worker.engine.executor.models.qwen3 import Qwen3ForCausalLM

MODEL_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# NOTE: a config.json without ``architectures`` (transformers writes none when it converts a GGUF, as
# worker/model_prepare.py does for the built-in model) is resolved by its ``model_type``.
ARCHITECTURE_OF_MODEL_TYPE: dict[str, str] = {
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is one the engine cannot run (message says why)."""


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """Tokens a sliding-window layer attends to (Hugging Face: ``q_pos - kv_pos < sliding_window``), or
    ``None`` when no layer uses a window. Qwen2/Qwen3 configs list per-layer ``layer_types``; Mistral's
    ``sliding_window`` applies to every layer."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def resolve_model_class(config: PretrainedConfig, max_model_len: int) -> type[LlamaForCausalLM]:
    """The implementation for ``config``: its first supported ``architectures`` entry, or, when the
    config lists none, the causal LM of its ``model_type`` (:data:`ARCHITECTURE_OF_MODEL_TYPE`).

    Args:
        config: the checkpoint's Hugging Face config.
        max_model_len: the most tokens one sequence may hold (prompt + output).

    Raises:
        UnsupportedModelError: when no listed architecture is supported (the message lists those that
            are), or when a sliding window shorter than ``max_model_len`` would change the attention.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = str(getattr(config, "model_type", ""))
    candidates = architectures or [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, "")]
    model_class = next((MODEL_ARCHITECTURES[a] for a in candidates if a in MODEL_ARCHITECTURES), None)
    if model_class is None:
        named = architectures or f"(none listed; model_type {model_type!r})"
        raise UnsupportedModelError(
            f"unsupported model architecture {named}; supported: {', '.join(sorted(MODEL_ARCHITECTURES))}"
        )
    window = sliding_window_of(config)
    if window is not None and window < max_model_len:
        raise UnsupportedModelError(
            f"config.json sets sliding_window={window}, below max_model_len={max_model_len}, and sliding-window "
            f"attention is not implemented; set max_model_len <= {window}"
        )
    return model_class

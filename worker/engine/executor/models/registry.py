"""Which model class serves which checkpoint: ``config.json``'s ``architectures`` -> implementation.

As vLLM's model registry: the architecture name Hugging Face writes into ``config.json`` picks the
class. Mistral is Llama with a sliding window on every layer; it reuses :class:`LlamaForCausalLM` as is
(every model applies its config's windows: :func:`~worker.engine.executor.models.llama.layer_sliding_windows`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.engine.executor.models.bert import BertModel
from worker.engine.executor.models.gemma2 import Gemma2ForCausalLM
from worker.engine.executor.models.gemma3 import Gemma3ForCausalLM
from worker.engine.executor.models.llama import LlamaForCausalLM
from worker.engine.executor.models.phi3 import Phi3ForCausalLM
from worker.engine.executor.models.qwen2 import Qwen2ForCausalLM
from worker.engine.executor.models.qwen3 import Qwen3ForCausalLM

MODEL_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is one the engine cannot run (message says why)."""


def resolve_model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The implementation for ``config``: its first supported ``architectures`` entry, or, when the
    config lists none, the causal LM of its ``model_type`` (:data:`ARCHITECTURE_OF_MODEL_TYPE`).

    Raises:
        UnsupportedModelError: when no listed architecture is supported (the message lists those that are).
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
    return model_class


# Encoders served for embeddings (worker/engine/pooling_engine.py), by ``model_type``: the heads a checkpoint
# may carry (``BertForMaskedLM`` ...) are dropped, the encoder under them is the same.
ENCODER_ARCHITECTURES: dict[str, type[BertModel]] = {"bert": BertModel}


def is_encoder_config(config: PretrainedConfig) -> bool:
    """Whether ``config`` is an encoder the engine serves (:data:`ENCODER_ARCHITECTURES`): an embedding model."""
    return str(getattr(config, "model_type", "")) in ENCODER_ARCHITECTURES


def model_kind_of(config: PretrainedConfig) -> str:
    """``"embed"`` for an encoder, else ``"generate"``: the kind a model has when the settings name none
    (a decoder embedder, such as Qwen3-Embedding, is a decoder checkpoint the settings mark ``embed``)."""
    return "embed" if is_encoder_config(config) else "generate"

"""Tiny random checkpoints of every supported family, built with transformers' own config and model
classes and saved with ``save_pretrained`` (plus the byte tokenizer of :mod:`tests.helpers.tiny_llama`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.helpers.tiny_llama import TINY_DECODER_FIELDS, build_byte_tokenizer

# family -> (config class, model class, family-specific config fields); all GQA (4 heads / 2 KV heads).
FAMILIES: dict[str, tuple[type[transformers.PretrainedConfig], type[transformers.PreTrainedModel], dict[str, Any]]] = {
    # alternating local/global layers, attention and final logit soft-caps small enough to bend the scores.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
    # one sliding and one full layer, each with its own RoPE; query scale and head_dim of their own.
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 4096}),
    # half of each head rotated (Phi-4-mini's partial_rotary_factor is 0.75), the rest passed through.
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    # head_dim 32 with hidden 64 and 4 heads: q is 128 wide, independent of hidden_size / heads.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}


def save_tiny_model(
    path: str | Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Save a randomly initialised 2-layer, hidden-64 model of ``family`` (see :data:`FAMILIES`) at ``path``.

    Weights are stored in ``dtype`` (``torch.bfloat16`` gives a bf16 checkpoint); ``max_shard_size``
    (e.g. ``"40KB"``) splits them into shards with a ``model.safetensors.index.json``. The random init
    is widened (std 0.1) so that greedy decoding does not collapse onto one token.
    """
    config_class, model_class, family_fields = FAMILIES[family]
    fields: dict[str, Any] = {**TINY_DECODER_FIELDS, "initializer_range": 0.1}
    fields.update(family_fields)
    fields.update(config_overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    # NOTE: HF initialises biases to zero and norm weights to one; perturbed ones let a parity test catch
    # a bias or a q/k norm that is dropped or misplaced.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.to(dtype)
    path = Path(path)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    build_byte_tokenizer().save_pretrained(path)
    return path


def save_tiny_bert(path: str | Path, *, pooling: str = "pooling_mode_mean_tokens", seed: int = 0) -> Path:
    """Save a randomly initialised 2-layer, hidden-64 BERT (128 positions, the byte tokenizer) at ``path`` as a
    sentence-transformers folder: the Pooling module asks for ``pooling``, a Normalize module follows."""
    path = Path(path)
    config = transformers.BertConfig(
        vocab_size=TINY_DECODER_FIELDS["vocab_size"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    transformers.BertModel(config).eval().save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({pooling: True}))
    return path

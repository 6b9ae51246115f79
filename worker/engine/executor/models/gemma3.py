"""Gemma 3 text models (Gemma team 2025; Hugging Face's ``Gemma3ForCausalLM``, e.g. gemma-3-1b).

Gemma 2's layout (:mod:`.gemma2`: ``1 + w`` norms, four norms per layer, scaled embeddings, GeGLU,
alternating local/global layers, soft-capping) with per-head q/k RMSNorm (``1 + w``) and one RoPE table
per layer type (local base for ``sliding_attention`` layers, possibly scaled global base for
``full_attention``). ``attn_logit_softcapping`` is ignored, as Hugging Face's ``Gemma3Attention`` ignores it
(Gemma 3 replaced soft-capping with the q/k norms; its released configs set it to null).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.engine.executor.models.gemma2 import (
    Gemma2ForCausalLM,
    GemmaDecoderLayer,
    ScaledEmbedding,
    check_causal,
)
from worker.engine.executor.models.llama import (
    DecoderOptions,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
    head_size_of,
    layer_sliding_windows,
)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Hugging Face's ``Gemma3ForCausalLM`` (text only) over a flat ragged batch.

    Raises:
        ValueError: at construction, for bidirectional attention (an embedding-model setting).
    """

    @classmethod
    def build_model(cls, config: PretrainedConfig) -> LlamaModel:
        check_causal(config)
        head_size = head_size_of(config)
        options = DecoderOptions(
            qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
            qk_norm=True,
            norm_unit_offset=True,
            query_scale=float(config.query_pre_attn_scalar) ** -0.5,
        )
        rotary = {t: RotaryEmbedding(config, head_size, layer_type=t) for t in sorted(set(config.layer_types))}
        windows = layer_sliding_windows(config)
        return LlamaModel(
            ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5),
            (
                GemmaDecoderLayer(config, rotary[t], options, w)
                for t, w in zip(config.layer_types, windows, strict=True)
            ),
            RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True),
        )

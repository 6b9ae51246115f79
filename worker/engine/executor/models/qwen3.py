"""Qwen3 (Qwen team 2025): Llama-shaped, with RMSNorm over each head of q and k before RoPE.

``head_dim`` is its own config field (not ``hidden_size // num_attention_heads``); biases follow
``attention_bias`` on all four projections, as in Hugging Face's ``Qwen3Attention``.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.engine.executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Qwen3ForCausalLM`` (dense) over a flat ragged batch."""

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

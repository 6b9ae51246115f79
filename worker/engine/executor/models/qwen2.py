"""Qwen2 / Qwen2.5 (Qwen team 2024): Llama-shaped, with a bias on the q/k/v projections only."""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.engine.executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Qwen2ForCausalLM`` (also Qwen2.5) over a flat ragged batch."""

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False)

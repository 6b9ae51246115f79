"""Gemma 3 text models (Gemma team 2025; Hugging Face's ``Gemma3ForCausalLM``, e.g. gemma-3-1b).

Built from Llama's parts: :class:`LlamaAttention` with per-head q/k RMSNorm and the
``query_pre_attn_scalar`` scale, and :func:`LlamaForCausalLM.load_weights`. What Gemma adds: norms of
the form ``1 + weight``, a norm after attention and around the MLP as well (four per layer), embeddings
scaled by ``sqrt(hidden_size)``, a tanh-approximated GELU gate, one RoPE table per layer type (local
base for ``sliding_attention`` layers, possibly scaled global base for ``full_attention``), and an
optional final logit soft-cap. Sliding layers compute full attention, which the registry allows only
when ``max_model_len <= sliding_window``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from worker.engine.executor.layers.attention import AttentionMetadata
from worker.engine.executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
    head_size_of,
)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``embed_scale`` (cast to the weight dtype first, as Hugging Face does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class GeluMLP(LlamaMLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate/up fused (GeGLU; Shazeer 2020)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out: torch.Tensor = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return out


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, options: DecoderOptions) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.self_attn = LlamaAttention(config, rotary_emb, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.mlp = GeluMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        out: torch.Tensor = hidden_states + self.post_feedforward_layernorm(mlp)
        return out


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Gemma3ForCausalLM`` (text only) over a flat ragged batch.

    Raises:
        ValueError: at construction, for attention-logit soft-capping (not in the attention kernels)
            or bidirectional attention (an embedding-model setting).
    """

    @classmethod
    def build_model(cls, config: PretrainedConfig) -> LlamaModel:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is set in config.json: attention soft-capping is not implemented")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is set in config.json: only causal attention is supported")
        head_size = head_size_of(config)
        options = DecoderOptions(
            qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
            qk_norm=True,
            norm_unit_offset=True,
            query_scale=float(config.query_pre_attn_scalar) ** -0.5,
        )
        rotary = {t: RotaryEmbedding(config, head_size, layer_type=t) for t in sorted(set(config.layer_types))}
        return LlamaModel(
            ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5),
            (Gemma3DecoderLayer(config, rotary[t], options) for t in config.layer_types),
            RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As Llama's, then ``cap * tanh(logits / cap)`` when ``final_logit_softcapping`` is set."""
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

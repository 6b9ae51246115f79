"""Gemma 2 (Gemma team 2024; Hugging Face's ``Gemma2ForCausalLM``), and the parts Gemma 3 reuses.

Built from Llama's parts (:class:`LlamaAttention`, :func:`LlamaForCausalLM.load_weights`). What Gemma adds:
norms of the form ``1 + weight``, a norm after attention and around the MLP as well (four per layer),
embeddings scaled by ``sqrt(hidden_size)``, a tanh-approximated GELU gate (GeGLU), the attention scale
``query_pre_attn_scalar ** -0.5``, local (``sliding_attention``, windowed) and global layers alternating
as ``layer_types`` lists them, and soft-capping: ``cap * tanh(s / cap)`` on the scaled attention scores
(``attn_logit_softcapping``, every attention path supports it) and on the final logits
(``final_logit_softcapping``).

Mixed local/global layers share one block table per sequence, so no block is freed as the window moves:
the global layers still read every position (docs/engine.md, "Sliding-window attention").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from worker.engine.executor.layers.attention import AttentionMetadata, KVCache
from worker.engine.executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
    head_size_of,
    layer_sliding_windows,
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


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3 layer: ``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_ff_norm(mlp(pre_ff_norm(.)))``."""

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        options: DecoderOptions,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.self_attn = LlamaAttention(config, rotary_emb, options, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.mlp = GeluMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        out: torch.Tensor = hidden_states + self.post_feedforward_layernorm(mlp)
        return out


def check_causal(config: PretrainedConfig) -> None:
    """Raises ValueError when ``use_bidirectional_attention`` is set (an embedding-model setting)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is set in config.json: only causal attention is supported")


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Gemma2ForCausalLM`` over a flat ragged batch.

    Raises:
        ValueError: at construction, for bidirectional attention.
    """

    @classmethod
    def build_model(cls, config: PretrainedConfig) -> LlamaModel:
        check_causal(config)
        options = DecoderOptions(
            qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
            query_scale=float(config.query_pre_attn_scalar) ** -0.5,
            logits_soft_cap=config.attn_logit_softcapping,
        )
        rotary = RotaryEmbedding(config, head_size_of(config))
        return LlamaModel(
            ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5),
            (GemmaDecoderLayer(config, rotary, options, window) for window in layer_sliding_windows(config)),
            RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As Llama's, then ``cap * tanh(logits / cap)`` when ``final_logit_softcapping`` is set."""
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

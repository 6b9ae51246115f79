"""The EAGLE draft head: one decoder layer over the target's features (Li et al. 2024, "EAGLE").

At position ``p`` the head reads ``concat(embed(x[p + 1]), f[p])``, the embedding of the next token and the
target's last hidden state at ``p`` (its final-norm output, which the LM head reads: the ``hidden_states[-1]``
EAGLE's data generation takes from Hugging Face models), projects it with ``fc`` (``2 * hidden -> hidden``)
and runs one Llama decoder layer (causal attention over the head's own earlier positions, SwiGLU MLP) to
predict ``f[p + 1]``; the target's frozen LM head turns a predicted feature into next-token logits. Drafting
feeds each predicted feature back with the embedding of the token drawn from it. The embedding and LM head
are the target's (never stored with the head).

Weights use the published EAGLE layout (``yuhuili/EAGLE-*``: ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.
{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``;
its first layer has no ``input_layernorm``, which is applied when a checkpoint has one). Rotary embeddings are
plain RoPE with ``rope_theta`` (no scaling).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class EagleHeadConfig:
    """The head's shapes (Llama field names, as EAGLE's ``config.json``): sizes in elements."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fc_bias: bool = True
    input_layernorm: bool = False

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> EagleHeadConfig:
        """From our ``config.json`` or EAGLE's (a Llama config; ``head_dim`` defaults to hidden / heads)."""
        num_heads = int(fields["num_attention_heads"])
        return cls(
            hidden_size=int(fields["hidden_size"]),
            intermediate_size=int(fields["intermediate_size"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(fields.get("num_key_value_heads") or num_heads),
            head_dim=int(fields.get("head_dim") or int(fields["hidden_size"]) // num_heads),
            rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
            rope_theta=float(fields.get("rope_theta", 10000.0)),
            fc_bias=bool(fields.get("fc_bias", fields.get("bias", True))),
            input_layernorm=bool(fields.get("input_layernorm", False)),
        )

    @classmethod
    def for_target(cls, target_config: Any) -> EagleHeadConfig:
        """A head shaped like one decoder layer of the target (what ``batchinfer heads train`` builds)."""
        num_heads = int(target_config.num_attention_heads)
        return cls(
            hidden_size=int(target_config.hidden_size),
            intermediate_size=int(target_config.intermediate_size),
            num_attention_heads=num_heads,
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(target_config, "head_dim", None) or int(target_config.hidden_size) // num_heads),
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(getattr(target_config, "rope_theta", None) or 10000.0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"head_type": "eagle", **asdict(self)}


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hugging Face's rotate-half RoPE; ``x: [heads, m, head_dim]``, ``positions: [m]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        m = x.shape[0]
        q = self._rope(self.q_proj(x).view(m, self.num_heads, self.head_dim).transpose(0, 1), positions)
        k = self._rope(self.k_proj(x).view(m, self.num_kv_heads, self.head_dim).transpose(0, 1), positions)
        v = self.v_proj(x).view(m, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
        num_past = k.shape[1] - m
        # Query i sits at key index num_past + i and sees keys up to it (causal), unless told otherwise.
        mask = (
            visible
            if visible is not None
            else torch.ones(m, k.shape[1], dtype=torch.bool, device=x.device).tril(diagonal=num_past)
        )
        repeat = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0), attn_mask=mask
        )
        projected: torch.Tensor = self.o_proj(out.transpose(0, 1).reshape(m, self.num_heads * self.head_dim))
        return projected, (k, v)


class _MLP(nn.Module):
    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _DecoderLayer(nn.Module):
    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps) if config.input_layernorm else None
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)


class EagleHead(nn.Module):
    """EAGLE's feature predictor (no embedding, no LM head: the caller passes the target's).

    :meth:`forward` runs ``m`` consecutive positions of one sequence after ``past`` (its earlier positions'
    K/V), so the same call trains over a whole sequence (``past=None``) and drafts one position at a time.
    """

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([_DecoderLayer(config)])

    def forward(
        self,
        features: torch.Tensor,
        next_token_embeds: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Predict the next features.

        Args:
            features: ``[m, hidden_size]`` the (target's or predicted) features at positions ``p``.
            next_token_embeds: ``[m, hidden_size]`` the target's embeddings of tokens ``p + 1``.
            positions: ``LongTensor[m]`` the positions ``p`` (consecutive, after ``past``'s, unless ``visible``).
            past: the K/V of this sequence's earlier positions, ``([kv_heads, n, head_dim], [kv_heads, n, head_dim])``.
            visible: bool ``[m, n + m]``: which keys (``past``'s, then these rows') each row attends; None: causal.
                A draft tree's rows see the committed entries and their own ancestors only.

        Returns:
            the predicted features at ``p + 1``, ``[m, hidden_size]``, and the K/V including these positions.
        """
        x = self.fc(torch.cat((next_token_embeds, features), dim=-1))
        layer = self.layers[0]
        assert isinstance(layer, _DecoderLayer)
        normed = layer.input_layernorm(x) if layer.input_layernorm is not None else x
        attn, present = layer.self_attn(normed, positions, past, visible)
        x = x + attn
        out: torch.Tensor = x + layer.mlp(layer.post_attention_layernorm(x))
        return out, present

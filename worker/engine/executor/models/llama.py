"""Llama decoder (Touvron et al. 2023) over a flat ragged batch with a paged KV cache.

Llama-shaped families (Mistral, Qwen2, Qwen3) reuse these classes through :class:`DecoderOptions`
(biases, per-head q/k RMSNorm); see :mod:`worker.engine.executor.models.registry`.

Same mathematics as Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary position embeddings,
grouped-query attention, SwiGLU MLP, optional tied embeddings), laid out as in vLLM: no batch
dimension and no padding (``[num_tokens, hidden_size]``), q/k/v fused into one ``qkv_proj`` and
gate/up into one ``gate_up_proj``, attention through :func:`paged_attention_forward`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.cpu_elementwise import (
    add_rms_norm_cpu,
    decoder_attention_input_cpu,
    decoder_attention_output_mlp_cpu,
    is_bf16_kind,
    rms_norm_cpu,
    rotary_embedding_cpu_,
    silu_and_mul_cpu,
)
from worker.engine.executor.forward_context import step_is_batch_invariant
from worker.engine.executor.layers.attention import AttentionMetadata, KVCache, paged_attention_forward
from worker.engine.executor.models.checkpoint_copy import CheckpointLayout, copy_into_layout


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32 as Hugging Face does.

    ``x: [..., hidden_size]`` -> same shape and dtype. ``unit_offset`` scales by ``1 + weight`` in
    float32 before casting back (Gemma's layout, weights stored around zero) instead of Llama's
    ``weight * normed.to(dtype)``. With ``use_cpu_kernels`` (:func:`enable_cpu_kernels`) one C++ pass per
    row computes the same (:func:`kernels.cpu_elementwise.rms_norm_cpu`).
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.use_cpu_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels:
            return rms_norm_cpu(x, self.weight.detach(), self.eps, self.unit_offset)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: ``(x + delta, self(x + delta))``, one pass with the C++ kernels."""
        if self.use_cpu_kernels:
            return add_rms_norm_cpu(x, delta, self.weight.detach(), self.eps, self.unit_offset)
        total = x + delta
        return total, self(total)


def head_size_of(config: PretrainedConfig) -> int:
    """Per-head width: ``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(config.num_attention_heads)


def layer_sliding_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer, the keys a sliding-window layer attends to (Hugging Face: ``q_pos - k_pos < sliding_window``),
    or ``None`` for a global layer. Configs with ``layer_types`` (Qwen2/Qwen3, Gemma 2/3) window their
    ``sliding_attention`` layers; Mistral's and Phi-3's ``sliding_window`` applies to every layer."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [int(window)] * num_layers
    return [int(window) if layer_type == "sliding_attention" else None for layer_type in layer_types]


def num_kv_heads_of(config: PretrainedConfig) -> int:
    """KV heads (grouped-query attention); a config without ``num_key_value_heads`` has one per query head."""
    return int(config.num_key_value_heads or config.num_attention_heads)


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """What a Llama-shaped family changes in the attention block.

    ``qkv_bias``/``o_bias``: bias on the q/k/v and on the output projections (Qwen2: q/k/v only).
    ``qk_norm``: RMSNorm over each head's ``head_size`` on q and k before RoPE (Qwen3), with
    ``norm_unit_offset`` Gemma's ``1 + weight`` form. ``query_scale``: the attention scale when it is not
    ``head_size ** -0.5`` (Gemma 2/3: ``query_pre_attn_scalar ** -0.5``). ``logits_soft_cap``: Gemma 2's
    attention soft-cap, ``cap * tanh(s / cap)`` on the scaled scores.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_unit_offset: bool = False
    query_scale: float | None = None
    logits_soft_cap: float | None = None


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (Su et al. 2021), "rotate half" layout as in Hugging Face's Llama.

    ``cos``/``sin`` tables for positions ``0 .. max_position_embeddings - 1`` are precomputed once
    (float32, then cast to the model dtype, exactly as Hugging Face computes them per call). Inverse
    frequencies come from transformers' ``ROPE_INIT_FUNCTIONS``, so ``default``, ``linear``, ``llama3``
    and ``yarn`` ``rope_parameters`` give the same numbers as transformers. A ``partial_rotary_factor``
    below 1 rotates only each head's first ``rotary_dim = head_size * factor`` channels (Phi-3 family).
    ``layer_type`` picks that entry of per-layer-type ``rope_parameters`` (Gemma 3).

    ``longrope`` (Phi-3 128k; Ding et al. 2024, "LongRoPE") has two frequency sets, ``short_factor`` and
    ``long_factor``, both with the config's attention scaling. The table then holds the short set at rows
    ``0 .. max_position_embeddings - 1`` and the long set at the next ``max_position_embeddings`` rows
    (``long_rope_offset``); the caller picks a set per token by offsetting its position
    (:func:`long_rope_positions`).

    Raises:
        ValueError: for ``dynamic`` scaling, whose frequencies depend on the running sequence length.
    """

    def __init__(self, config: PretrainedConfig, head_size: int, layer_type: str | None = None) -> None:
        super().__init__()
        # Per-layer-type parameters (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``).
        rope_parameters = (config.rope_parameters or {}) if layer_type is None else config.rope_parameters[layer_type]
        rope_type = str(rope_parameters.get("rope_type", "default"))
        if rope_type == "dynamic":
            raise ValueError("dynamic rope scaling is not supported (its frequencies depend on the sequence length)")
        self.rotary_dim = int(head_size * float(rope_parameters.get("partial_rotary_factor", 1.0)))
        # NOTE: tables are built on the CPU whatever the default device; the module is moved afterwards.
        cpu = torch.device("cpu")
        if rope_type == "default":
            base = float(rope_parameters["rope_theta"] or 10000.0)
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=cpu).float() / self.rotary_dim
            inv_freq = 1.0 / (base**exponents)
            attention_scaling = 1.0
        else:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, layer_type=layer_type)
        self.long_rope_offset: int | None = None
        if rope_type == "longrope":
            # transformers picks the long factors for a seq_len past original_max_position_embeddings.
            original_max = int(rope_parameters["original_max_position_embeddings"])
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, seq_len=original_max + 1)
            self.long_rope_offset = int(config.max_position_embeddings)
            inv_freq = torch.stack((inv_freq, long_inv_freq))  # [2, rotary_dim // 2]: short, long
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=cpu)
        freqs = (positions[:, None] * inv_freq.view(-1, 1, inv_freq.shape[-1])).flatten(0, 1)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = nn.Buffer(emb.cos() * attention_scaling, persistent=False)
        self.sin = nn.Buffer(emb.sin() * attention_scaling, persistent=False)
        self.use_cpu_kernels = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [num_tokens, num_heads, head_size]`` by its tokens' ``positions: [num_tokens]``.

        With ``use_cpu_kernels`` (:func:`enable_cpu_kernels`) and the whole head rotated, ``x`` is rotated
        in place by one C++ pass (:func:`kernels.cpu_elementwise.rotary_embedding_cpu_`) and returned.
        """
        if self.use_cpu_kernels and self.rotary_dim == x.shape[-1]:
            rotary_embedding_cpu_(x, positions, self.cos, self.sin)
            return x
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        x_rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = x_rot * cos + rotated * sin
        if self.rotary_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., self.rotary_dim :]), dim=-1)


def long_rope_positions(
    positions: torch.Tensor, seq_lens: torch.Tensor, original_max_position_embeddings: int, long_rope_offset: int
) -> torch.Tensor:
    """Rows of a ``longrope`` table (:class:`RotaryEmbedding`) for each token: the long set when its sequence
    (all its tokens, prompt and output so far) is longer than ``original_max_position_embeddings``.

    That is what Hugging Face's Phi-3 ``generate`` computes: a forward pass picks the set from its longest
    position (``longrope_frequency_update``), and when a sequence first grows past the limit its cache is
    dropped and every token recomputed with the long set (``prepare_inputs_for_generation``); the engine's
    scheduler recomputes such a sequence likewise (:meth:`KVCacheManager.needs_recompute`).

    Args:
        positions: ``LongTensor[num_tokens]``; seq_lens: ``LongTensor[num_tokens]``, the length of each token's
            sequence (``Sequence.num_tokens``).
        original_max_position_embeddings: the pretraining context; long_rope_offset: the long set's first row.

    Returns:
        ``LongTensor[num_tokens]`` rows of the cos/sin table.
    """
    return positions + (seq_lens > original_max_position_embeddings).long() * long_rope_offset


class LlamaAttention(nn.Module):
    """Self-attention over the paged KV cache; ``sliding_window`` makes it a local layer that sees only
    its last ``sliding_window`` positions."""

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        options: DecoderOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = num_kv_heads_of(config)
        self.head_size = head_size_of(config)
        self.scale = self.head_size**-0.5 if options.query_scale is None else options.query_scale
        self.qkv_proj = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_size, bias=options.qkv_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_size, config.hidden_size, bias=options.o_bias)
        offset = options.norm_unit_offset
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, offset) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, offset) if options.qk_norm else None
        self.rotary_emb = rotary_emb
        self.sliding_window = sliding_window
        self.logits_soft_cap = options.logits_soft_cap

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states).view(num_tokens, -1, self.head_size)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # One rotation for q and k together: they are adjacent heads of the fused projection.
        qk = self.rotary_emb(positions, qk)
        query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        value = qkv[:, self.num_heads + self.num_kv_heads :]
        out = self.attend(query, key, value, kv_cache, attn_metadata)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_size))
        return projected

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """:func:`paged_attention_forward` with this layer's scale, sliding window and logits soft cap (its
        :meth:`forward` and :class:`FusedCpuLayer` both attend through it)."""
        return paged_attention_forward(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.use_cpu_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels:  # x: [num_tokens, hidden_size]
            activated: torch.Tensor = self.down_proj(silu_and_mul_cpu(self.gate_up_proj(x)))
            return activated
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


@dataclass(frozen=True, slots=True)
class _FusedLinear:
    """A linear layer as the fused decoder-layer kernels take it: weight, kind (0 packed float32,
    ``PACKED_BF16_KIND`` packed bfloat16, ``gguf_bf16_kind`` Q4 panels for bfloat16, else a ggml block type id;
    :mod:`kernels.cpu_elementwise`), output features, bias; ``module`` is read for
    ``quantize_activations`` on every call where it has one."""

    module: nn.Module
    weight: torch.Tensor
    kind: int
    out_features: int
    bias: torch.Tensor | None


def _fused_linear(module: nn.Module) -> _FusedLinear | None:
    """``module`` for the fused kernels when it offers a C++ weight (``cpu_kernel_weight``: float32 or bfloat16
    ``PackedLinear``, ``GGUFLinear``, ``GGUFLinearBF16``), else None."""
    kernel_weight = getattr(module, "cpu_kernel_weight", None)
    found: tuple[torch.Tensor, int] | None = kernel_weight() if callable(kernel_weight) else None
    if found is None:
        return None
    bias: torch.Tensor | None = getattr(module, "bias", None)
    out_features: int = getattr(module, "out_features")  # noqa: B009 (typed: nn.Module's __getattr__ is not)
    return _FusedLinear(module, found[0], found[1], out_features, None if bias is None else bias.detach())


@dataclass(frozen=True, slots=True)
class FusedCpuLayer:
    """What a float32 or bfloat16 :class:`LlamaDecoderLayer` on the C++ kernels runs as two calls around its
    attention (:func:`kernels.cpu_elementwise.decoder_attention_input_cpu` and
    :func:`~kernels.cpu_elementwise.decoder_attention_output_mlp_cpu`): the same kernels in the same order as its
    modules, without the Python and op dispatch between them (issue #27: about a sixth of a batch-1 q4 step; a
    tenth of the bfloat16 mixed workload's CPU time, docs/engine.md). ``dtype`` is the activations' (bfloat16 with
    packed bfloat16 weights and Q4 panels, in any mix; float32 with the others); the norm weights are held in float32, as the kernels take
    them. Built by :func:`enable_cpu_kernels`; the submodules' own forward hooks do not fire on this path."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    input_eps: float
    post_eps: float
    qkv: _FusedLinear
    o: _FusedLinear
    gate_up: _FusedLinear
    down: _FusedLinear
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    # the linear modules that can switch to int8 activations (GGUFLinear's quantize_activations), read every call
    switchable: tuple[nn.Module, ...]

    @classmethod
    def of(cls, layer: LlamaDecoderLayer) -> FusedCpuLayer | None:
        """The fused form of ``layer``, or None where it does not apply: another layer, attention or MLP class
        (a family's own), q/k norms, a unit-offset norm, partial rotary, a linear layer without a float32
        C++ kernel (``nn.Linear``, a bfloat16 layer on oneDNN), weights whose kind is not the tables' dtype's
        (bfloat16 tables need packed bfloat16 weights or Q4 panels), or kernels not enabled."""
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        if any(type(n) is not RMSNorm or n.unit_offset or not n.use_cpu_kernels for n in norms):
            return None
        rotary = attn.rotary_emb
        if attn.q_norm is not None or not rotary.use_cpu_kernels or rotary.rotary_dim != attn.head_size:
            return None
        dtype = rotary.cos.dtype
        if dtype not in (torch.float32, torch.bfloat16) or not mlp.use_cpu_kernels:
            return None
        linears = [_fused_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        qkv, o, gate_up, down = linears
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        if any(is_bf16_kind(linear.kind) != (dtype == torch.bfloat16) for linear in (qkv, o, gate_up, down)):
            return None
        return cls(
            # NOTE: float32 as the module path widens them on every call (rms_norm_cpu); a float32 weight is itself.
            norms[0].weight.detach().float(),
            norms[1].weight.detach().float(),
            norms[0].eps,
            norms[1].eps,
            qkv,
            o,
            gate_up,
            down,
            rotary.cos,
            rotary.sin,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_size,
            dtype,
            tuple(
                linear.module for linear in (qkv, o, gate_up, down) if hasattr(linear.module, "quantize_activations")
            ),
        )

    def applies(self, hidden_states: torch.Tensor) -> bool:
        """Activations of ``dtype`` everywhere (a ``GGUFLinear`` may have been switched to int8 activations)."""
        # NOTE: only the switchable modules are asked: a missing attribute costs nn.Module.__getattr__'s slow path.
        return hidden_states.dtype == self.dtype and not any(module.quantize_activations for module in self.switchable)

    def forward(
        self,
        attention: LlamaAttention,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """:meth:`LlamaDecoderLayer.forward`, the attention itself through :meth:`LlamaAttention.attend`; in a step
        that must be batch invariant (:func:`~worker.engine.executor.forward_context.step_is_batch_invariant`) Q4
        panels run their exact chain at every height, as ``GGUFLinearBF16`` does."""
        num_tokens, head_size, qkv = hidden_states.shape[0], self.head_size, self.qkv
        heads, kv_heads = self.num_heads, self.num_kv_heads
        batch_invariant = step_is_batch_invariant()
        rotated = decoder_attention_input_cpu(
            hidden_states,
            self.input_norm,
            self.input_eps,
            qkv.weight,
            qkv.kind,
            qkv.out_features,
            qkv.bias,
            positions,
            self.cos,
            self.sin,
            heads + kv_heads,
            head_size,
            batch_invariant,
        ).view(num_tokens, -1, head_size)
        out = attention.attend(
            rotated[:, :heads],
            rotated[:, heads : heads + kv_heads],
            rotated[:, heads + kv_heads :],
            kv_cache,
            attn_metadata,
        )
        o, gate_up, down = self.o, self.gate_up, self.down
        return decoder_attention_output_mlp_cpu(
            out.reshape(num_tokens, heads * head_size),
            hidden_states,
            o.weight,
            o.kind,
            o.bias,
            self.post_norm,
            self.post_eps,
            gate_up.weight,
            gate_up.kind,
            gate_up.out_features,
            gate_up.bias,
            down.weight,
            down.kind,
            down.bias,
            batch_invariant,
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        options: DecoderOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary_emb, options, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.fused_cpu: FusedCpuLayer | None = None  # set by enable_cpu_kernels where it applies

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        fused = self.fused_cpu
        if fused is not None and fused.applies(hidden_states):
            return fused.forward(self.self_attn, positions, hidden_states, kv_cache, attn_metadata)
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states, normed = self.post_attention_layernorm.add_forward(hidden_states, attn)
        out: torch.Tensor = hidden_states + self.mlp(normed)
        return out


def enable_cpu_kernels(model: nn.Module) -> None:
    """Switch the model's norms, rotary tables and SwiGLU MLPs to the fused C++ kernels
    (:mod:`kernels.cpu_elementwise`); for a float32 model on CPU with the kernels available (the loader
    calls it when :func:`~worker.engine.executor.layers.linear.pack_linear_layers` packed the model).
    A subclass that overrides ``forward`` (Gemma's GeGLU MLP) keeps its own path. Llama decoder layers whose
    linear layers all have float32-activation C++ kernels then run as two C++ calls around their attention
    (:class:`FusedCpuLayer`); call it again after swapping a layer's modules."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding)) or type(module) is LlamaMLP:
            module.use_cpu_kernels = True
    for module in model.modules():
        if isinstance(module, LlamaDecoderLayer):
            module.fused_cpu = FusedCpuLayer.of(module)


class LlamaModel(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm``; each layer maps ``(positions, hidden_states, kv_cache,
    attn_metadata)`` to new hidden states. A family with other layers or norms passes its own."""

    def __init__(self, embed_tokens: nn.Embedding, layers: Iterable[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class LlamaForCausalLM(nn.Module):
    """Llama causal LM over a flat ragged batch.

    Build from a ``transformers.LlamaConfig`` (or a Llama-shaped one), then :meth:`load_weights` with Hugging Face names
    (``model.layers.N.self_attn.q_proj.weight`` ...). Parameters are created with ordinary random
    initialisation; :func:`worker.engine.executor.model_loader.load_model` does both steps.
    A Llama-shaped family subclasses it and overrides :meth:`decoder_options`; one whose checkpoint
    already stores ``qkv_proj``/``gate_up_proj`` fused sets ``checkpoint_is_fused``.
    """

    checkpoint_is_fused: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.layer_sliding_windows = layer_sliding_windows(config)
        self.model = self.build_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build_model(cls, config: PretrainedConfig) -> LlamaModel:
        """The decoder stack: Llama layers with :meth:`decoder_options` and their sliding windows
        (:func:`layer_sliding_windows`), sharing one rotary table."""
        options = cls.decoder_options(config)
        rotary_emb = RotaryEmbedding(config, head_size_of(config))
        # NOTE: built on the meta device (every tensor is then replaced by a prepared one), the embedding skips its
        # random init: normal_ on a meta tensor runs torch._refs, whose first call imports torch._dynamo (about
        # half a CPU-second of each warm worker start).
        meta_weight = (
            torch.empty(config.vocab_size, config.hidden_size) if torch.get_default_device().type == "meta" else None
        )
        return LlamaModel(
            nn.Embedding(config.vocab_size, config.hidden_size, _weight=meta_weight),
            (LlamaDecoderLayer(config, rotary_emb, options, window) for window in layer_sliding_windows(config)),
            RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    @classmethod
    def decoder_options(cls, config: PretrainedConfig) -> DecoderOptions:
        """Llama: ``attention_bias`` on all four projections, no q/k norm."""
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias)

    @property
    def sliding_window(self) -> int | None:
        """The window of the model's sliding-window layers (all share one), or None when every layer is global."""
        return next((window for window in self.layer_sliding_windows if window is not None), None)

    @property
    def long_rope_original_max(self) -> int | None:
        """``original_max_position_embeddings`` when the model uses ``longrope`` scaling (its tokens' rotary
        rows then depend on their sequence's length: :func:`long_rope_positions`), else None."""
        rope_parameters = getattr(self.config, "rope_parameters", None) or {}
        if rope_parameters.get("rope_type") != "longrope":
            return None
        return int(rope_parameters["original_max_position_embeddings"])

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer is windowed (Mistral): blocks wholly before the window are never read again."""
        return None not in self.layer_sliding_windows

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over one step's tokens.

        Args:
            input_ids: ``LongTensor[num_tokens]``, sequence by sequence (as ``attn_metadata`` orders them).
            positions: ``LongTensor[num_tokens]`` position of each token in its sequence.
            kv_caches: one cache per layer (``[2, num_blocks, block_size, num_kv_heads, head_size]`` or quantized);
                this step's K/V are written into them.
            attn_metadata: the step's :class:`AttentionMetadata`.

        Returns:
            Final-norm hidden states ``[num_tokens, hidden_size]`` in the model dtype.

        Raises:
            ValueError: if the number of KV caches is not the number of layers.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        hidden_states: torch.Tensor = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        out: torch.Tensor = self.model.norm(hidden_states)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_sampled, hidden_size]`` -> float32 logits ``[num_sampled, vocab_size]``."""
        logits: torch.Tensor = self.lm_head(hidden_states)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model, fusing q/k/v and gate/up on the way.

        Tensors are converted to each parameter's dtype (bf16/fp16/fp32 checkpoints alike) and device.
        ``lm_head.weight`` is skipped when the embeddings are tied; ``rotary_emb.inv_freq`` entries are
        ignored (recomputed).

        Raises:
            KeyError: on a checkpoint tensor this model has no parameter for (named).
            ValueError: on a shape mismatch, or naming the checkpoint tensors that never came.
        """
        tied = bool(self.config.tie_word_embeddings)
        kept = (
            (name, name, tensor)
            for name, tensor in weights
            if "rotary_emb.inv_freq" not in name and not (name == "lm_head.weight" and tied)
        )
        copy_into_layout(self._checkpoint_layout(), kept, model_name=type(self).__name__)

    def _checkpoint_layout(self) -> CheckpointLayout:
        """Hugging Face tensor name -> (our parameter, first row, rows or ``None`` for the whole parameter)."""
        head_size = head_size_of(self.config)
        q_size = int(self.config.num_attention_heads) * head_size
        kv_size = num_kv_heads_of(self.config) * head_size
        intermediate = int(self.config.intermediate_size)
        # fused parameter -> its Hugging Face parts as (projection, row offset, rows)
        fused = {
            "qkv_proj": [("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)],
            "gate_up_proj": [("gate_proj", 0, intermediate), ("up_proj", intermediate, intermediate)],
        }
        layout: dict[str, tuple[nn.Parameter, int, int | None]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            *module, fused_name, kind = name.split(".")
            if fused_name not in fused or self.checkpoint_is_fused:
                layout[name] = (param, 0, None)
                continue
            for part, start, rows in fused[fused_name]:
                layout[".".join([*module, part, kind])] = (param, start, rows)
        return layout

"""BERT encoder (Devlin et al. 2019) over packed variable-length sequences, for embeddings.

Same mathematics as Hugging Face's ``BertModel`` (absolute position and token-type embeddings, post-norm
layers, exact-erf GELU), laid out as the decoders are (:mod:`worker.engine.executor.models.llama`): no batch
dimension and no padding (``[num_tokens, hidden_size]``, sequence by sequence), q/k/v fused into one
``qkv_proj``. Attention is bidirectional within each sequence: :func:`packed_bidirectional_attention`, or
with ``use_cpu_kernels`` (:meth:`BertModel.enable_cpu_kernels`, float32 on CPU) the C++ kernels: varlen
attention over ``cu_seqlens`` (:func:`kernels.cpu_attention.varlen_attention_cpu`), the residual add with its
projection's bias and LayerNorm in one pass (:mod:`kernels.cpu_elementwise`), and the four linears on oneDNN
with prepacked weights, the up projection's bias and GELU in its GEMM
(:mod:`worker.engine.executor.layers.onednn_linear`; MKL's ``F.linear`` and the C++ bias+GELU where oneDNN is
absent). On oneDNN a packed batch is padded to a multiple of 64 rows by one extra sequence of [PAD] tokens,
dropped before returning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from kernels.cpu_attention import varlen_attention_cpu
from kernels.cpu_elementwise import add_layer_norm_cpu, bias_gelu_cpu_
from worker.engine.executor.layers.onednn_linear import (
    onednn_linear_available,
    pack_linear_weight,
    packed_linear,
    padded_rows,
)
from worker.engine.executor.models.checkpoint_copy import CheckpointLayout, copy_into_layout

# Checkpoint tensors an encoder for embeddings has no use for: the position-id buffer and the pooler head
# (the NSP/classification ``tanh`` layer; sentence-transformers pools the last hidden state itself).
_IGNORED_PREFIXES = ("embeddings.position_ids", "pooler.")
# Wrappers (``BertForMaskedLM``, ``BertForSequenceClassification``) store the encoder under ``bert.``.
_WRAPPER_PREFIX = "bert."
_ONEDNN_BATCH_HINT = 4096  # rows oneDNN lays the packed weights out for (the engine's batches: 1-8192 tokens)


def packed_bidirectional_attention(
    qkv: torch.Tensor, seq_lens: list[int], num_heads: int, head_size: int, scale: float
) -> torch.Tensor:
    """Full (non-causal) attention of each packed sequence over its own tokens.

    Consecutive sequences of the same length go to one ``scaled_dot_product_attention`` call as a batch
    (the engine sorts its inputs by length, so a batch holds long runs of equal lengths); no padding and no
    mask are ever built, so no FLOP is spent across sequences.

    Args:
        qkv: ``[num_tokens, 3 * num_heads * head_size]``, the fused projection (q, then k, then v).
        seq_lens: tokens per sequence, in packing order; they sum to ``num_tokens``.
        num_heads, head_size: attention shape; scale: the softmax scale (``head_size ** -0.5``).

    Returns:
        ``[num_tokens, num_heads * head_size]`` attention outputs, same dtype as ``qkv``.
    """
    num_tokens = qkv.shape[0]
    out = qkv.new_empty(num_tokens, num_heads * head_size)
    start, i = 0, 0
    while i < len(seq_lens):
        length = seq_lens[i]
        run = 1
        while i + run < len(seq_lens) and seq_lens[i + run] == length:
            run += 1
        end = start + run * length
        # [run * L, 3, H, D] -> 3 x [run, H, L, D]
        q, k, v = qkv[start:end].view(run, length, 3, num_heads, head_size).permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[start:end].view(run, length, num_heads, head_size).copy_(attended.transpose(1, 2))
        start, i = end, i + run
    return out


class BertEmbeddings(nn.Module):
    """Word + absolute position + token-type embeddings, then LayerNorm (type 0 for every token: one segment)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.use_cpu_kernels = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels:
            return add_layer_norm_cpu(
                self.word_embeddings(input_ids),
                self.position_embeddings(positions),
                self.token_type_embeddings.weight[0],
                self.LayerNorm.weight,
                self.LayerNorm.bias,
                self.LayerNorm.eps,
            )
        embedded = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        embedded += self.token_type_embeddings.weight[0]
        out: torch.Tensor = self.LayerNorm(embedded)
        return out


class BertLayer(nn.Module):
    """Post-norm encoder layer: ``x = LN(x + attn(x)); x = LN(x + down(gelu(up(x))))``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.head_size = hidden // self.num_heads
        self.scale = self.head_size**-0.5
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up_proj = nn.Linear(hidden, int(config.intermediate_size))
        self.down_proj = nn.Linear(int(config.intermediate_size), hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.use_cpu_kernels = False
        self.onednn_weights: tuple[torch.Tensor, ...] | None = None  # qkv, o, up, down: pack_onednn_weights
        self.onednn_dtype = torch.float32  # what the packed weights and the linears' inputs are

    def forward(self, hidden_states: torch.Tensor, seq_lens: list[int], cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels:
            return self._forward_cpu_kernels(hidden_states, cu_seqlens)
        attended = packed_bidirectional_attention(
            self.qkv_proj(hidden_states), seq_lens, self.num_heads, self.head_size, self.scale
        )
        hidden_states = self.attention_norm(hidden_states + self.o_proj(attended))
        # NOTE: exact (erf) GELU, BERT's ``hidden_act="gelu"``; the tanh form differs in the 4th decimal.
        out: torch.Tensor = self.output_norm(hidden_states + self.down_proj(F.gelu(self.up_proj(hidden_states))))
        return out

    def _forward_cpu_kernels(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The same layer on the C++ kernels: biases of o/down added in the fused residual+LayerNorm passes."""
        num_tokens = hidden_states.shape[0]
        qkv = self._linear(0, hidden_states, self.qkv_proj.bias)
        query, key, value = qkv.view(num_tokens, 3, self.num_heads, self.head_size).unbind(1)
        attended = varlen_attention_cpu(query, key, value, cu_seqlens, self.scale).view(num_tokens, -1)
        norm = self.attention_norm
        projected = self._linear(1, attended)
        hidden_states = add_layer_norm_cpu(hidden_states, projected, self.o_proj.bias, norm.weight, norm.bias, norm.eps)
        projected = self._linear(3, self._linear(2, hidden_states, self.up_proj.bias, gelu=True))
        norm = self.output_norm
        return add_layer_norm_cpu(hidden_states, projected, self.down_proj.bias, norm.weight, norm.bias, norm.eps)

    def _linear(
        self, index: int, x: torch.Tensor, bias: torch.Tensor | None = None, *, gelu: bool = False
    ) -> torch.Tensor:
        """Projection ``index`` (0 qkv, 1 o, 2 up, 3 down) of ``x`` plus ``bias``, then exact GELU when ``gelu``:
        on oneDNN's packed weights (:meth:`pack_onednn_weights`; bias and GELU in the GEMM's pass, ``x`` cast to
        bfloat16 and the result back to float32 when they are bfloat16), else ``F.linear`` (MKL) with GELU by the
        C++ bias+GELU pass."""
        if self.onednn_weights is not None:
            if self.onednn_dtype == torch.float32:
                return packed_linear(x, self.onednn_weights[index], bias, gelu=gelu)
            return packed_linear(x.to(self.onednn_dtype), self.onednn_weights[index], bias, gelu=gelu).float()
        weight = self._linears()[index].weight
        if not gelu:
            return F.linear(x, weight, bias)
        assert bias is not None  # NOTE: GELU follows the up projection only, which has a bias
        out = F.linear(x, weight)
        bias_gelu_cpu_(out, bias)
        return out

    def _linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        return self.qkv_proj, self.o_proj, self.up_proj, self.down_proj

    def pack_onednn_weights(self, batch_size_hint: int, dtype: torch.dtype = torch.float32) -> None:
        """Reorder qkv, o, up and down weights for oneDNN (:func:`pack_linear_weight`), as ``dtype`` (float32, or
        bfloat16 for AMX/AVX-512-BF16 products); the parameters stay as they are (the torch path and
        ``load_weights`` use them), so re-pack after loading new weights."""
        self.onednn_dtype = dtype
        self.onednn_weights = tuple(
            pack_linear_weight(linear.weight.to(dtype), batch_size_hint) for linear in self._linears()
        )


class BertModel(nn.Module):
    """BERT encoder over a packed batch: token ids -> last hidden states (no pooler head).

    Build from a ``transformers.BertConfig``, then :meth:`load_weights` with Hugging Face names
    (``encoder.layer.N.attention.self.query.weight`` ..., optionally under ``bert.``);
    :func:`worker.engine.executor.model_loader.load_model` does both steps.

    Raises:
        UnsupportedModelError: (from the registry) a ``position_embedding_type`` other than ``absolute`` or
            an activation other than ``gelu``.
    """

    is_encoder = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from worker.engine.executor.models.registry import UnsupportedModelError

        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"BERT with {config.position_embedding_type} positions is not supported")
        if config.hidden_act != "gelu":
            raise UnsupportedModelError(f"BERT with hidden_act {config.hidden_act!r} is not supported (gelu is)")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(int(config.num_hidden_layers)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Encode packed sequences.

        Args:
            input_ids: ``LongTensor[num_tokens]``, sequence after sequence.
            positions: ``LongTensor[num_tokens]``, each token's position in its sequence (``0 .. len - 1``).
            seq_lens: tokens per sequence (host list), summing to ``num_tokens``.

        Returns:
            Last hidden states ``[num_tokens, hidden_size]`` in the model dtype (Hugging Face's
            ``last_hidden_state`` without the padding rows).
        """
        num_tokens = input_ids.shape[0]
        cu_lens = [0, *itertools.accumulate(seq_lens)]
        first = self.layers[0]
        on_onednn = first.use_cpu_kernels and first.onednn_weights is not None
        padding = padded_rows(num_tokens) - num_tokens if on_onednn else 0
        if padding:
            # NOTE: one extra sequence of [PAD] rows (its own attention, dropped at the end), so that oneDNN
            # sees few distinct heights and reuses its compiled primitives (onednn_linear.padded_rows).
            input_ids = torch.cat([input_ids, input_ids.new_zeros(padding)])
            positions = torch.cat([positions, torch.arange(padding, dtype=positions.dtype, device=positions.device)])
            cu_lens.append(num_tokens + padding)
        hidden_states: torch.Tensor = self.embeddings(input_ids, positions)
        cu_seqlens = torch.tensor(cu_lens, dtype=torch.int32)
        for layer in self.layers:
            hidden_states = layer(hidden_states, seq_lens, cu_seqlens)
        return hidden_states[:num_tokens]

    def enable_cpu_kernels(self, matmul_dtype: torch.dtype = torch.float32) -> None:
        """Run every layer and the embeddings on the C++ kernels (:mod:`kernels.cpu_attention`,
        :mod:`kernels.cpu_elementwise`); for a float32 model on CPU with
        :func:`kernels.cpu_extension.cpu_kernels_available` (the caller checks; the head size must be a
        multiple of 8 and the intermediate size too, as BERT's are), the linears on oneDNN's prepacked weights
        where :func:`onednn_linear_available` (call again after loading new weights: it packs them).

        ``matmul_dtype`` bfloat16 runs the four linears' products in bfloat16 (weights and inputs rounded to it,
        float32 bias and results; AMX where the CPU has it), everything else in float32: opt-in, not the float32
        reference (docs/engine.md, "Embeddings").

        Raises:
            ValueError: bfloat16 asked where torch has no oneDNN or this CPU no bfloat16 support.
        """
        use_onednn = onednn_linear_available()
        if matmul_dtype != torch.float32 and not (use_onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            raise ValueError(f"matmul dtype {matmul_dtype} needs oneDNN with bfloat16 support on this CPU")
        for module in self.modules():
            if isinstance(module, (BertEmbeddings, BertLayer)):
                module.use_cpu_kernels = True
            if use_onednn and isinstance(module, BertLayer):
                module.pack_onednn_weights(_ONEDNN_BATCH_HINT, matmul_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model, fusing query/key/value on the way.

        Raises:
            KeyError: on a checkpoint tensor this model has no parameter for (named).
            ValueError: on a shape mismatch, or naming the checkpoint tensors that never came.
        """
        kept = (
            (raw_name, name, tensor)
            for raw_name, tensor in weights
            if not (name := raw_name.removeprefix(_WRAPPER_PREFIX)).startswith(_IGNORED_PREFIXES)
            and not raw_name.startswith(("cls.", "classifier."))
        )
        copy_into_layout(self._checkpoint_layout(), kept, model_name=type(self).__name__)

    def _checkpoint_layout(self) -> CheckpointLayout:
        """Hugging Face tensor name -> (our parameter, first row, rows or ``None`` for the whole parameter)."""
        hidden = int(self.config.hidden_size)
        layout: dict[str, tuple[nn.Parameter, int, int | None]] = {}
        for name, param in self.embeddings.named_parameters():
            layout[f"embeddings.{name}"] = (param, 0, None)
        for index, layer in enumerate(self.layers):
            prefix = f"encoder.layer.{index}."
            for kind in ("weight", "bias"):
                qkv = getattr(layer.qkv_proj, kind)
                for part, projection in enumerate(("query", "key", "value")):
                    layout[f"{prefix}attention.self.{projection}.{kind}"] = (qkv, part * hidden, hidden)
                for ours, theirs in (
                    (layer.o_proj, "attention.output.dense"),
                    (layer.attention_norm, "attention.output.LayerNorm"),
                    (layer.up_proj, "intermediate.dense"),
                    (layer.down_proj, "output.dense"),
                    (layer.output_norm, "output.LayerNorm"),
                ):
                    layout[f"{prefix}{theirs}.{kind}"] = (getattr(ours, kind), 0, None)
        return layout

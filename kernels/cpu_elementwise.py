"""C++ fused elementwise layers for float32 models on CPU: RMSNorm (with the residual add), SwiGLU's
``silu(gate) * up`` and rotary embeddings applied in place (decoders); the residual add with LayerNorm and
the bias with exact GELU (encoders). Also a float32 Llama decoder layer in two calls around its attention
(:func:`decoder_attention_input_cpu`, :func:`decoder_attention_output_mlp_cpu`), which chain these kernels and
the linear layers' in C++ to spare a batch the Python and dispatch between them (float32, or bfloat16 with packed
bfloat16 weights or Q4 panels). The
decoder's elementwise ops also take bfloat16 tensors: widened to float32 row by row inside the kernel, computed
by the same float32 code, and each result rounded to bfloat16 once (the PyTorch bfloat16 expressions round after
each op, so the two differ by bfloat16 rounding).

The source is ``cpu_elementwise.cpp`` next to this file, built with the other CPU kernels by
:mod:`kernels.cpu_extension` (check :func:`kernels.cpu_extension.cpu_kernels_available` first). Each op
makes one pass over a row where PyTorch's eager ops make several, and each output row depends on its own
input row only (batch invariant). References: the PyTorch expressions in each docstring, equal up to
float32 rounding.

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels

PACKED_BF16_KIND = -1
"""The ``kind`` of a packed bfloat16 weight (:func:`kernels.cpu_gemm.pack_linear_weight_bf16`) in the fused decoder-layer
kernels (:func:`decoder_attention_input_cpu`): bfloat16 activations, no ggml block type id is negative."""


def gguf_bf16_kind(block_type: int) -> int:
    """The ``kind`` of Q4_0 / Q4_1 panels packed by :func:`kernels.cpu_q4.gguf_pack_bf16` (bfloat16 activations) in
    the fused decoder-layer kernels: the negated ggml type id, -2 (Q4_0) or -3 (Q4_1).

    Raises:
        ValueError: for another block type.
    """
    if block_type not in (2, 3):
        raise ValueError(f"ggml block type {block_type} has no bfloat16 kernel (Q4_0 = 2 and Q4_1 = 3 do)")
    return -block_type


def is_bf16_kind(kind: int) -> bool:
    """Whether a fused-kernel weight ``kind`` runs on bfloat16 activations (:data:`PACKED_BF16_KIND`,
    :func:`gguf_bf16_kind`'s); the others (0, the ggml type ids) run on float32 ones."""
    return kind < 0


def _float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when float32, else widened to float32."""
    return x if x.dtype == torch.float32 else x.float()


def _native(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels take its dtype (float32, bfloat16: widened row by row inside), else widened to
    float32 (the result is then rounded back by the caller)."""
    return x if x.dtype in (torch.float32, torch.bfloat16) else x.float()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of each row: ``weight * (x * rsqrt(mean(x ** 2) + eps))``.

    Args:
        x: float32 or bfloat16 CPU ``[..., hidden_size]`` with unit stride in the last dimension.
        weight: float32 or bfloat16 contiguous ``[hidden_size]``; eps: added to the mean square.
        unit_offset: scale by ``1 + weight`` (Gemma's layout) instead of ``weight``.

    Returns:
        contiguous, ``x``'s shape and dtype.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    rows = _native(x.reshape(-1, x.shape[-1]))
    out: torch.Tensor = torch.ops.batchinfer_cpu.rms_norm(rows, _float32(weight), eps, unit_offset)
    return out.to(x.dtype).view(x.shape)


def add_rms_norm_cpu(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: ``(x + delta, rms_norm(x + delta))``.

    Args:
        x, delta: float32 or bfloat16 CPU ``[num_tokens, hidden_size]`` with unit stride in the last dimension.
        weight, eps, unit_offset: as in :func:`rms_norm_cpu`.

    Returns:
        ``(sum, normed)``, both contiguous ``[num_tokens, hidden_size]`` in ``x.dtype``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    dtype = x.dtype
    if delta.dtype == x.dtype:
        x, delta = _native(x), _native(delta)
    else:
        x, delta = _float32(x), _float32(delta)
    total, normed = torch.ops.batchinfer_cpu.add_rms_norm(x, delta, _float32(weight), eps, unit_offset)
    return total.to(dtype), normed.to(dtype)


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``.

    Args:
        gate_up: float32 or bfloat16 CPU ``[num_tokens, 2 * intermediate_size]`` with unit stride in the last
            dimension.

    Returns:
        contiguous ``[num_tokens, intermediate_size]`` in ``gate_up.dtype``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: torch.Tensor = torch.ops.batchinfer_cpu.silu_and_mul(_native(gate_up))
    return out.to(gate_up.dtype)


def rotary_embedding_cpu_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` in place by rotary embeddings (Su et al. 2021), "rotate half" layout as in Hugging Face's
    Llama: ``x * cos[positions] + cat(-x2, x1) * sin[positions]`` over each head's whole width.

    Args:
        x: float32 or bfloat16 CPU ``[num_tokens, num_heads, head_size]`` with unit stride in the last dimension
            (a view into a fused projection is fine); modified in place.
        positions: int64 ``[num_tokens]``, rows of the tables.
        cos, sin: contiguous ``[max_positions, head_size]``, float32 (bfloat16 with a bfloat16 ``x``).

    Raises:
        RuntimeError: when the kernels are unavailable, on a position outside the tables, or on other shapes,
            dtypes or devices.
    """
    require_cpu_kernels()
    if x.dtype == torch.float32:
        torch.ops.batchinfer_cpu.rotary_embedding_(x, positions, _float32(cos), _float32(sin))
        return
    if x.dtype == torch.bfloat16 and cos.dtype == sin.dtype == torch.bfloat16:
        torch.ops.batchinfer_cpu.rotary_embedding_(x, positions, cos, sin)  # widened row by row inside
        return
    # NOTE: only this step's table rows are widened (a whole bfloat16 table would cost more than the rotation)
    wide = x.float()
    rows = torch.arange(positions.numel())
    cos_rows, sin_rows = cos.index_select(0, positions).float(), sin.index_select(0, positions).float()
    torch.ops.batchinfer_cpu.rotary_embedding_(wide, rows, cos_rows, sin_rows)
    x.copy_(wide)


def add_layer_norm_cpu(
    x: torch.Tensor,
    delta: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A post-norm residual step in one pass: ``layer_norm(x + delta + bias, weight, beta, eps)`` (Ba et al. 2016;
    torch's order: mean, then the biased variance of the centred row).

    ``delta`` is typically a projection computed without its bias, which this adds (``None``: no bias).

    Args:
        x, delta: float32 CPU ``[num_tokens, hidden_size]`` with unit stride in the last dimension.
        bias: optional float32 contiguous ``[hidden_size]``; weight, beta: float32 contiguous ``[hidden_size]``.
        eps: added to the variance.

    Returns:
        float32 contiguous ``[num_tokens, hidden_size]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: torch.Tensor = torch.ops.batchinfer_cpu.add_layer_norm(x, delta, bias, weight, beta, eps)
    return out


def bias_gelu_cpu_(x: torch.Tensor, bias: torch.Tensor) -> None:
    """``x = gelu(x + bias)`` in place, the exact (erf) GELU (Hendrycks & Gimpel 2016) that BERT's
    ``hidden_act="gelu"`` names: ``0.5 * v * (1 + erf(v / sqrt(2)))``, with erf by Abramowitz & Stegun 7.1.26
    (absolute error 1.5e-7, the approximation torch's vectorised erf uses).

    Args:
        x: float32 CPU ``[num_tokens, width]`` with unit stride in the last dimension, ``width`` a multiple
            of 8; modified in place.
        bias: float32 contiguous ``[width]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    torch.ops.batchinfer_cpu.bias_gelu_(x, bias)


def decoder_attention_input_cpu(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_kind: int,
    qkv_features: int,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_heads: int,
    head_size: int,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """A Llama decoder layer up to attention in one call: ``qkv = linear(rms_norm(x))``, then rotary embeddings
    on its first ``rotated_heads`` heads (q and k) in place; the same kernels in the same order as
    :func:`rms_norm_cpu`, the linear layer's op and :func:`rotary_embedding_cpu_` one by one (same bits).

    Args:
        x: float32 or bfloat16 CPU ``[num_tokens, hidden_size]``, unit stride in the last dimension.
        norm_weight: float32 ``[hidden_size]`` (Llama's RMSNorm, no unit offset); eps: its epsilon.
        qkv_weight, qkv_kind: the projection's weight: ``kind`` 0 a packed float32 weight
            (:func:`kernels.cpu_gemm.pack_linear_weight`), :data:`PACKED_BF16_KIND` a packed bfloat16 weight
            (:func:`kernels.cpu_gemm.pack_linear_weight_bf16`, bfloat16 ``x``), :func:`gguf_bf16_kind` Q4 panels
            (:func:`kernels.cpu_q4.gguf_pack_bf16`, bfloat16 ``x``), else the ggml block type id of GGUF blocks
            (:func:`kernels.cpu_q4.linear_gguf`, float32 activations).
        qkv_features: the projection's output features; qkv_bias: optional ``[qkv_features]``.
        positions, cos, sin: as :func:`rotary_embedding_cpu_` (tables in ``x``'s dtype).
        rotated_heads: heads rotated from the first; head_size: the width of a head.
        batch_invariant: Q4 panels run their exact-weight chain at every height
            (:func:`kernels.cpu_q4.linear_gguf_bf16`); the other kinds are batch invariant without it.

    Returns:
        contiguous ``[num_tokens, qkv_features]`` in ``x``'s dtype.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: torch.Tensor = torch.ops.batchinfer_cpu.decoder_attention_input(
        x,
        norm_weight,
        eps,
        qkv_weight,
        qkv_kind,
        qkv_features,
        qkv_bias,
        positions,
        cos,
        sin,
        rotated_heads,
        head_size,
        batch_invariant,
    )
    return out


def decoder_attention_output_mlp_cpu(
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    o_kind: int,
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_kind: int,
    gate_up_features: int,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_kind: int,
    down_bias: torch.Tensor | None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """A Llama decoder layer after attention in one call: ``h = residual + o_proj(attn)``, then
    ``h + down(silu_and_mul(gate_up(rms_norm(h))))``; the same kernels in the same order as the module path
    (:func:`add_rms_norm_cpu`, :func:`silu_and_mul_cpu` and the linear layers' ops; same bits).

    Args:
        attn: float32 CPU ``[num_tokens, num_heads * head_size]``; residual: float32 ``[num_tokens, hidden_size]``
            (both bfloat16 with packed bfloat16 weights or Q4 panels, in any mix).
        o_weight, o_kind, o_bias; gate_up_weight, gate_up_kind, gate_up_bias; down_weight, down_kind, down_bias:
            the three projections as in :func:`decoder_attention_input_cpu` (``o`` and ``down`` output
            ``hidden_size`` features, ``gate_up`` ``gate_up_features``: gate, then up).
        norm_weight, eps: the post-attention RMSNorm.
        batch_invariant: as in :func:`decoder_attention_input_cpu`.

    Returns:
        contiguous ``[num_tokens, hidden_size]`` in ``residual``'s dtype, the layer's output.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: torch.Tensor = torch.ops.batchinfer_cpu.decoder_attention_output_mlp(
        attn,
        residual,
        o_weight,
        o_kind,
        o_bias,
        norm_weight,
        eps,
        gate_up_weight,
        gate_up_kind,
        gate_up_features,
        gate_up_bias,
        down_weight,
        down_kind,
        down_bias,
        batch_invariant,
    )
    return out

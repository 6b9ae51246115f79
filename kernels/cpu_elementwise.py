"""C++ fused elementwise layers for float32 models on CPU: RMSNorm (with the residual add), SwiGLU's
``silu(gate) * up`` and rotary embeddings applied in place (decoders); the residual add with LayerNorm and
the bias with exact GELU (encoders).

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


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of each row: ``weight * (x * rsqrt(mean(x ** 2) + eps))``.

    Args:
        x: float32 CPU ``[..., hidden_size]`` with unit stride in the last dimension.
        weight: float32 contiguous ``[hidden_size]``; eps: added to the mean square.
        unit_offset: scale by ``1 + weight`` (Gemma's layout) instead of ``weight``.

    Returns:
        float32 contiguous, ``x``'s shape.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    rows = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = torch.ops.batchinfer_cpu.rms_norm(rows, weight, eps, unit_offset)
    return out.view(x.shape)


def add_rms_norm_cpu(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: ``(x + delta, rms_norm(x + delta))``.

    Args:
        x, delta: float32 CPU ``[num_tokens, hidden_size]`` with unit stride in the last dimension.
        weight, eps, unit_offset: as in :func:`rms_norm_cpu`.

    Returns:
        ``(sum, normed)``, both float32 contiguous ``[num_tokens, hidden_size]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: tuple[torch.Tensor, torch.Tensor] = torch.ops.batchinfer_cpu.add_rms_norm(x, delta, weight, eps, unit_offset)
    return out


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``.

    Args:
        gate_up: float32 CPU ``[num_tokens, 2 * intermediate_size]`` with unit stride in the last dimension.

    Returns:
        float32 contiguous ``[num_tokens, intermediate_size]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on other shapes, dtypes or devices.
    """
    require_cpu_kernels()
    out: torch.Tensor = torch.ops.batchinfer_cpu.silu_and_mul(gate_up)
    return out


def rotary_embedding_cpu_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` in place by rotary embeddings (Su et al. 2021), "rotate half" layout as in Hugging Face's
    Llama: ``x * cos[positions] + cat(-x2, x1) * sin[positions]`` over each head's whole width.

    Args:
        x: float32 CPU ``[num_tokens, num_heads, head_size]`` with unit stride in the last dimension (a view
            into a fused projection is fine); modified in place.
        positions: int64 ``[num_tokens]``, rows of the tables.
        cos, sin: float32 contiguous ``[max_positions, head_size]``.

    Raises:
        RuntimeError: when the kernels are unavailable, on a position outside the tables, or on other shapes,
            dtypes or devices.
    """
    require_cpu_kernels()
    torch.ops.batchinfer_cpu.rotary_embedding_(x, positions, cos, sin)


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

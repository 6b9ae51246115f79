"""C++ linear layers for CPUs over a weight packed once into column panels: float32 (32 wide with AVX-512, else
16), and bfloat16 with float32 accumulation on CPUs with AVX512_BF16 (``cpu_gemm_bf16.cpp``, 32 wide).

The source is ``cpu_gemm.cpp`` next to this file, built with the other CPU kernels by
:mod:`kernels.cpu_extension` (check :func:`kernels.cpu_extension.cpu_kernels_available` first). Method:
the register-blocked micro-kernel of Goto & van de Geijn (2008), 12 rows x 32 columns per call with
AVX-512 (6 x 16 otherwise), activations repacked per block of rows; see the source's header. The
reference is :func:`torch.nn.functional.linear`.

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels


def panel_width() -> int:
    """Output columns per packed panel in this machine's build: 32 with AVX-512, 16 otherwise.

    Raises:
        RuntimeError: when the kernels are unavailable.
    """
    require_cpu_kernels()
    width: int = torch.ops.batchinfer_cpu.linear_panel_width()
    return width


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Pack an ``nn.Linear`` weight for :func:`linear_packed`.

    Args:
        weight: float32 CPU ``[out_features, in_features]`` (any strides).

    Returns:
        float32 contiguous ``[ceil(out_features / W), in_features, W]`` with ``W = panel_width()``: panel
        ``p`` holds output columns ``Wp .. Wp + W - 1`` transposed (``packed[p, k, c] = weight[Wp + c, k]``),
        zero padded.

    Raises:
        RuntimeError: when the kernels are unavailable, or on a weight that is not 2-D float32 on CPU.
    """
    require_cpu_kernels()
    packed: torch.Tensor = torch.ops.batchinfer_cpu.pack_linear_weight(weight)
    return packed


def linear_packed(
    x: torch.Tensor, packed_weight: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the weight as packed by :func:`pack_linear_weight`.

    Each output element is one fused multiply-add chain over the input features in order, so a row's
    result does not depend on how many rows share the call (batch invariant); it differs from
    :func:`torch.nn.functional.linear` (MKL) only by float32 rounding.

    Args:
        x: float32 CPU ``[..., in_features]`` with unit stride in the last dimension.
        packed_weight: from :func:`pack_linear_weight`.
        out_features: rows of the original weight.
        bias: optional float32 ``[out_features]``.

    Returns:
        float32 contiguous ``[..., out_features]``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on mismatched shapes or dtypes.
    """
    require_cpu_kernels()
    rows = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = torch.ops.batchinfer_cpu.linear_packed(rows, packed_weight, out_features, bias)
    return out.view(*x.shape[:-1], out_features)


def linear_bf16_supported() -> bool:
    """Whether this machine's build has the bfloat16 kernel (the CPU has AVX512_BF16: ``vdpbf16ps``).

    Raises:
        RuntimeError: when the kernels are unavailable.
    """
    require_cpu_kernels()
    supported: bool = torch.ops.batchinfer_cpu.linear_bf16_supported()
    return supported


def pack_linear_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """Pack a bfloat16 ``nn.Linear`` weight for :func:`linear_packed_bf16` (source ``cpu_gemm_bf16.cpp``).

    Args:
        weight: bfloat16 CPU ``[out_features, in_features]`` (any strides).

    Returns:
        bfloat16 contiguous ``[ceil(out_features / 32), ceil(in_features / 2), 32, 2]``:
        ``packed[p, j, c, i] = weight[32p + c, 2j + i]``, zero padded (pairs of consecutive input features
        per output column, the operand layout of ``vdpbf16ps``).

    Raises:
        RuntimeError: when the kernels are unavailable, the CPU lacks AVX512_BF16
            (:func:`linear_bf16_supported`), or on a weight that is not 2-D bfloat16 on CPU.
    """
    require_cpu_kernels()
    packed: torch.Tensor = torch.ops.batchinfer_cpu.pack_linear_weight_bf16(weight)
    return packed


def linear_packed_bf16(
    x: torch.Tensor, packed_weight: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` in bfloat16 with float32 accumulation, the weight packed by
    :func:`pack_linear_weight_bf16`.

    Each output element is one float32 chain over the input features in order (a pair per ``vdpbf16ps``),
    started at the bias and rounded to bfloat16 once (nearest even), so a row's result does not depend on
    how many rows share the call (batch invariant). Reference: :func:`kernels.reference.linear_bf16_reference`
    (equal up to float32 summation order, then one bfloat16 rounding).

    Args:
        x: bfloat16 CPU ``[..., in_features]`` with unit stride in the last dimension.
        packed_weight: from :func:`pack_linear_weight_bf16`.
        out_features: rows of the original weight.
        bias: optional ``[out_features]`` (any float dtype; added in float32).

    Returns:
        bfloat16 contiguous ``[..., out_features]``.

    Raises:
        RuntimeError: when the kernels are unavailable, the CPU lacks AVX512_BF16, or on mismatched shapes
            or dtypes.
    """
    require_cpu_kernels()
    rows = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = torch.ops.batchinfer_cpu.linear_packed_bf16(rows, packed_weight, out_features, bias)
    return out.view(*x.shape[:-1], out_features)

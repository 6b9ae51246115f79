"""C++ quantize-on-store for a quantized paged KV cache on CPUs (source ``cpu_kv_store.cpp`` next to this file,
built with the other CPU kernels by :mod:`kernels.cpu_extension`; check
:func:`kernels.cpu_extension.cpu_kernels_available` first).

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels


def quantize_kv_store_cpu(
    data: torch.Tensor,
    scales: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    return_stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Quantize ``key`` and ``value`` and store them at their slots, one pass per (token, KV head) row.

    Bit for bit :func:`kernels.reference.quantize_kv` of each row followed by indexed copies into ``data`` and
    ``scales`` (its twin): per group of ``head_size // num_groups`` channels, ``scale = max|x| / q_max`` (1 for
    an all-zero group), elements ``x / scale`` clamped to ``+-q_max`` and rounded (int8 half away from zero,
    float8 e4m3 to nearest even).

    Args:
        data: contiguous int8 or float8_e4m3fn ``[2, num_blocks, block_size, num_kv_heads, head_size]``; mutated.
        scales: contiguous float32 ``[2, num_blocks, block_size, num_kv_heads, num_groups]``, ``num_groups``
            dividing ``head_size`` (:func:`kernels.reference.kv_num_scale_groups`); mutated.
        key, value: float32 ``[num_tokens, num_kv_heads, head_size]``, unit stride in the last dimension.
        slot_mapping: contiguous int64 ``[num_tokens]`` of distinct slots in ``[0, num_blocks * block_size)``.
        return_stored: also return the rows as stored.

    Returns:
        With ``return_stored``, float32 contiguous ``(key, value)`` as later reads see them
        (``element * scale`` of its group); else None.

    Raises:
        RuntimeError: when the kernels are unavailable, or on bad shapes, dtypes, strides or slots.
    """
    require_cpu_kernels()
    if not return_stored:
        torch.ops.batchinfer_cpu.quantize_kv_store_(data, scales, key, value, slot_mapping)
        return None
    stored = (torch.empty(key.shape, dtype=torch.float32), torch.empty(value.shape, dtype=torch.float32))
    torch.ops.batchinfer_cpu.quantize_kv_store_(data, scales, key, value, slot_mapping, *stored)
    return stored

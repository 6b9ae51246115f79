"""C++ quantize-on-store for a quantized paged KV cache on CPUs, and the plain store of a float32 or bfloat16 one
(:func:`kv_store_cpu`) (source ``cpu_kv_store.cpp`` next to this file,
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


def kv_store_cpu(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key`` and ``value`` at their slots of a float32 or bfloat16 cache, each (token, KV head) row copied as
    it is: ``kv_cache.view(2, -1, num_kv_heads, head_size)[0].index_copy_(0, slot_mapping, key)`` and ``[1]`` with
    ``value`` (its twin), without the indexed copy's per-call cost.

    Args:
        kv_cache: contiguous float32 or bfloat16 ``[2, num_blocks, block_size, num_kv_heads, head_size]``; mutated.
        key, value: ``[num_tokens, num_kv_heads, head_size]`` in the cache's dtype, unit stride in the last
            dimension (strided views of a fused projection are fine).
        slot_mapping: contiguous int64 ``[num_tokens]`` of distinct slots in ``[0, num_blocks * block_size)``.

    Raises:
        RuntimeError: when the kernels are unavailable, or on bad shapes, dtypes, strides or slots.
    """
    require_cpu_kernels()
    torch.ops.batchinfer_cpu.kv_store_(kv_cache, key, value, slot_mapping)

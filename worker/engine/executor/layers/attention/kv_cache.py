"""The per-layer paged KV cache: the compute dtype (``kv_cache_dtype="auto"``) or quantized blocks.

A quantized cache (``"int8"``, ``"fp8_e4m3"``; vLLM's ``kv_cache_dtype``, its ``"fp8"`` an alias) keeps the
elements in one byte each, ``data: [2, num_blocks, block_size, num_kv_heads, head_size]`` (the layout of a
float cache, so block tables, slots and copy-on-write are unchanged), and beside it one float32 scale per
stored (token, KV head, group of channels), ``scales: [2, num_blocks, block_size, num_kv_heads, num_groups]``
(int8: groups of :data:`kernels.reference.KV_SCALE_GROUP_SIZE` channels, two at ``head_size`` 64; fp8: one
group a head, :func:`kernels.reference.kv_num_scale_groups`): a slot's scales belong to the slot, so every
operation on block ids (prefix caching, forks, preemption) carries them along.
``"int4"`` packs two 4-bit codes a byte, ``data: [..., head_size // 2]``, with a float32 scale and zero per
group of channels, ``scales: [..., 2 * num_groups]`` (:func:`kernels.reference.quantize_kv_int4`); no kernel
reads it yet, so an int4 engine attends gathered, dequantized blocks on every path.
Writes quantize (:func:`kernels.reference.quantize_kv`); the C++ kernel reads the blocks in place; the
PyTorch paths dequantize the blocks they gather (docs/engine.md, "Quantized KV cache").

Keys are smoothed before they are quantized: a layer's ``key_smoothing`` (one factor per KV head and channel,
calibrated once at load, :mod:`.kv_calibration`) divides every stored key and multiplies every query, so
``q . k`` is unchanged while the outlier channels of keys no longer set every token's scale (SmoothQuant's
migration of a channel's range, Xiao et al. 2023, applied to the per-channel outliers of keys that KIVI
quantizes per channel, Liu et al. 2024). The kernels see the stored keys and the scaled queries only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_kv_store import quantize_kv_store_cpu
from kernels.reference import (
    KV_STORAGE_DTYPES,
    dequantize_kv,
    dequantize_kv_int4,
    kv_int4_group_size,
    kv_num_scale_groups,
    quantize_kv,
    quantize_kv_int4,
)

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "int4")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The canonical name of ``kv_cache_dtype`` (``"fp8"`` -> ``"fp8_e4m3"``).

    Raises:
        ValueError: on a name not served; the message lists the served ones.
    """
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        served = ", ".join(repr(n) for n in (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES))
        raise ValueError(f"kv_cache_dtype must be one of {served}, got {kv_cache_dtype!r}")
    return name


def kv_cache_bytes_per_token_head(kv_cache_dtype: str, head_size: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) takes in K or V: ``head_size`` elements, plus a float32 scale per channel group
    when quantized (:func:`kernels.reference.kv_num_scale_groups`; int8 64 + 8 bytes at ``head_size`` 64, fp8
    64 + 4; int4: half a
    byte an element and a float32 scale and zero per group, :func:`kernels.reference.quantize_kv_int4`).

    Raises:
        ValueError: when quantized, on a ``head_size`` the groups do not divide (int4: or an odd one).
    """
    if kv_cache_dtype == "auto":
        return head_size * dtype.itemsize
    if kv_cache_dtype == "int4":
        return head_size // 2 + 2 * 4 * (head_size // kv_int4_group_size(head_size))
    return head_size * KV_STORAGE_DTYPES[kv_cache_dtype].itemsize + 4 * kv_num_scale_groups(head_size, kv_cache_dtype)


@dataclass(frozen=True, slots=True)
class QuantizedKVCache:
    """One layer's quantized blocks and their scales.

    Attributes:
        data: int8 or float8_e4m3fn ``[2, num_blocks, block_size, num_kv_heads, head_size]``; for int4, uint8
            ``[..., head_size // 2]``, two codes a byte.
        scales: float32 ``[2, num_blocks, block_size, num_kv_heads, num_groups]``; a value is ``element * scale``
            of its channel group (:func:`kernels.reference.quantize_kv`); for int4
            ``[..., 2 * num_groups]``, each group's scale and zero (:func:`kernels.reference.quantize_kv_int4`).
        kv_cache_dtype: ``"int8"``, ``"fp8_e4m3"`` or ``"int4"``.
        key_smoothing: float32 ``[num_kv_heads, head_size]``, positive: a stored key is ``k / key_smoothing``
            (the queries meet it as ``q * key_smoothing``, :meth:`smooth`); None: keys stored as they are.
    """

    data: torch.Tensor
    scales: torch.Tensor
    kv_cache_dtype: str
    key_smoothing: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        kv_cache_dtype: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        device: torch.device,
        key_smoothing: torch.Tensor | None = None,
    ) -> QuantizedKVCache:
        """A cache of zeros (never-written slots read as 0, as in a float cache), with ``key_smoothing``
        ``[num_kv_heads, head_size]`` or None.

        Raises:
            ValueError: on a ``key_smoothing`` of another shape or with an entry that is not positive, or on a
                ``head_size`` the channel groups do not divide (:func:`kernels.reference.kv_group_size`).
        """
        shape = (2, num_blocks, block_size, num_kv_heads)
        if kv_cache_dtype == "int4":
            data = torch.zeros(*shape, head_size // 2, dtype=torch.uint8, device=device)
            num_params = 2 * (head_size // kv_int4_group_size(head_size))
            scales = torch.zeros(*shape, num_params, dtype=torch.float32, device=device)
        else:
            data = torch.zeros(*shape, head_size, dtype=KV_STORAGE_DTYPES[kv_cache_dtype], device=device)
            num_groups = kv_num_scale_groups(head_size, kv_cache_dtype)
            scales = torch.zeros(*shape, num_groups, dtype=torch.float32, device=device)
        if key_smoothing is None:
            return cls(data, scales, kv_cache_dtype)
        if key_smoothing.shape != (num_kv_heads, head_size) or not bool((key_smoothing > 0).all()):
            raise ValueError(f"key_smoothing must be positive [{num_kv_heads}, {head_size}], got {key_smoothing}")
        return cls(data, scales, kv_cache_dtype, key_smoothing.to(device=device, dtype=torch.float32))

    def smooth(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query * key_smoothing, key / key_smoothing)``, the query's heads grouped on their KV head
        (``query: [num_tokens, num_heads, head_size]``, ``key: [num_tokens, num_kv_heads, head_size]``; new
        tensors in their dtypes): what the cache stores and what attends it, ``q . k`` unchanged. Without
        ``key_smoothing``, the arguments themselves."""
        if self.key_smoothing is None:
            return query, key
        num_queries_per_kv = query.shape[1] // key.shape[1]
        smoothing = self.key_smoothing.to(query.dtype)
        num_tokens, num_heads, head_size = query.shape
        grouped = query.view(num_tokens, key.shape[1], num_queries_per_kv, head_size)
        query = (grouped * smoothing[:, None]).view(num_tokens, num_heads, head_size)
        return query, key / smoothing.to(key.dtype)

    @property
    def shape(self) -> torch.Size:
        """The shape of a float cache of these blocks: ``data``'s (int4: its last dimension doubled)."""
        if self.kv_cache_dtype == "int4":
            return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))
        return self.data.shape

    @property
    def _bytes(self) -> torch.Tensor:
        # NOTE: indexed copies are not implemented for float8 on CPU; the bytes are the same, so move bytes.
        return self.data.view(torch.uint8)

    def write(
        self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *, return_stored: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Quantize and store ``key``, ``value`` (``[num_tokens, num_kv_heads, head_size]``) at their slots: one
        C++ pass on CPU in float32 when the kernels are available (:func:`kernels.cpu_kv_store.quantize_kv_store_cpu`,
        the same bytes), else :func:`kernels.reference.quantize_kv` and indexed copies.

        Returns:
            with ``return_stored``, the stored values dequantized, in ``key.dtype``: what every later read of
            these slots sees, so a fresh prompt attending its own K/V sees the same numbers as a cached prefix
            or a decode does; else None.
        """
        if self.kv_cache_dtype != "int4" and self._store_in_cpu_kernel(key, value):
            slots = slot_mapping.to(torch.int64)
            return quantize_kv_store_cpu(self.data, self.scales, key, value, slots, return_stored=return_stored)
        flat_data, flat_scales = self._bytes.flatten(1, 2), self.scales.flatten(1, 2)
        stored = []
        for half, x in enumerate((key, value)):
            if self.kv_cache_dtype == "int4":
                data, scales = quantize_kv_int4(x)
            else:
                data, scales = quantize_kv(x, self.kv_cache_dtype)
            flat_data[half].index_copy_(0, slot_mapping, data.view(torch.uint8))
            flat_scales[half].index_copy_(0, slot_mapping, scales)
            if return_stored:
                stored.append(self._dequantize(data, scales).to(x.dtype))
        return (stored[0], stored[1]) if return_stored else None

    def _store_in_cpu_kernel(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        return (
            self.data.device.type == "cpu"
            and key.dtype == value.dtype == torch.float32
            and key.stride(-1) == value.stride(-1) == 1
            and cpu_kernels_available()
        )

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``block_ids`` dequantized: ``[2, len(block_ids), block_size, num_kv_heads, head_size]`` in ``dtype``."""
        data = self._bytes.index_select(1, block_ids).view(self.data.dtype)
        return self._dequantize(data, self.scales.index_select(1, block_ids)).to(dtype)

    def _dequantize(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.kv_cache_dtype == "int4":
            return dequantize_kv_int4(data, scales)
        return dequantize_kv(data, scales)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block ``dst[i]`` becomes block ``src[i]``, elements and scales, reading both as before the call."""
        self._bytes.index_copy_(1, dst, self._bytes.index_select(1, src))
        self.scales.index_copy_(1, dst, self.scales.index_select(1, src))


KVCache = torch.Tensor | QuantizedKVCache
"""One layer's cache: a ``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor in the compute dtype, or
a :class:`QuantizedKVCache`."""


def gather_kv_blocks(kv_cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kv_cache``'s blocks ``block_ids`` as ``[2, n, block_size, num_kv_heads, head_size]`` (dequantized in
    ``dtype`` when quantized; a float cache's own dtype otherwise)."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.gather(block_ids, dtype)
    return kv_cache.index_select(1, block_ids)


def copy_slots(kv_cache: KVCache, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Slot ``dst_slots[i]`` (``block_id * block_size + offset``) becomes slot ``src_slots[i]``, K and V (and a
    quantized cache's scales), all read before any is written (mutates ``kv_cache``): the accepted path of a
    verified draft tree moves to the sequence's consecutive slots."""
    if isinstance(kv_cache, QuantizedKVCache):
        parts = [kv_cache._bytes.flatten(1, 2), kv_cache.scales.flatten(1, 2)]
    else:
        parts = [kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])]
    for flat in parts:
        flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))


def kv_cache_data_and_scales(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The arguments of the attention kernels: the element tensor and its scales (None for a float cache).

    Raises:
        ValueError: for an int4 cache (no kernel reads it).
    """
    if isinstance(kv_cache, QuantizedKVCache):
        if kv_cache.kv_cache_dtype == "int4":
            raise ValueError("no attention kernel reads an int4 KV cache; build the metadata without kernels")
        return kv_cache.data, kv_cache.scales
    return kv_cache, None

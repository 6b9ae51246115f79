"""Attention over the paged KV cache: per-step metadata and plan, the paged path, cascade (shared-prefix) attention."""

from worker.engine.executor.layers.attention.kv_cache import (
    KVCache,
    QuantizedKVCache,
    check_kv_cache_dtype,
    copy_slots,
)
from worker.engine.executor.layers.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    cpu_kernels_apply,
    triton_kernels_apply,
)
from worker.engine.executor.layers.attention.paged import paged_attention_forward, write_to_kv_cache
from worker.engine.executor.layers.attention.scratch import ScratchPrefill, scratch_prefill_metadata

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "QuantizedKVCache",
    "ScratchPrefill",
    "build_attention_metadata",
    "check_kv_cache_dtype",
    "copy_slots",
    "cpu_kernels_apply",
    "paged_attention_forward",
    "scratch_prefill_metadata",
    "triton_kernels_apply",
    "write_to_kv_cache",
]

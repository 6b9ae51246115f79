"""Metadata for a one-off forward over a scratch KV cache: every sequence one whole prefill.

Used where the model runs outside the scheduler, with a throw-away cache sized for the batch: the decoder
embedder (`worker.engine.pooling_engine`), the speculative heads' training features
(`worker.engine.spec_decode.heads.train`) and the KV cache's key calibration
(`worker.engine.executor.kv_calibration`). Each sequence gets ``ceil(seq_len / block_size)`` blocks of its
own, laid out one sequence after another from block 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.executor.layers.attention.metadata import AttentionMetadata, build_attention_metadata


@dataclass(slots=True)
class ScratchPrefill:
    """A scratch prefill's ``metadata`` and ``num_blocks``, the blocks its cache must hold
    (``[2, num_blocks, block_size, num_kv_heads, head_size]`` per layer)."""

    metadata: AttentionMetadata
    num_blocks: int


def scratch_prefill_metadata(
    seq_lens: Sequence[int],
    block_size: int,
    *,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    device: torch.device | str,
    sliding_window: int | None = None,
    use_cpu_kernels: bool | None = None,
    use_triton_kernels: bool | None = None,
) -> ScratchPrefill:
    """:func:`build_attention_metadata` for ``seq_lens`` (tokens per sequence, each ``>= 1``) as one prefill
    step into contiguous block tables: sequence ``i`` holds the blocks right after sequence ``i - 1``'s.

    The keyword arguments are :func:`build_attention_metadata`'s.

    Raises:
        ValueError: as :func:`build_attention_metadata` (e.g. a sequence of length 0).
    """
    block_tables: list[list[int]] = []
    num_blocks = 0
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        block_tables.append(list(range(num_blocks, num_blocks + count)))
        num_blocks += count
    metadata = build_attention_metadata(
        seq_lens,
        seq_lens,
        block_tables,
        block_size,
        num_queries_per_kv=num_queries_per_kv,
        dtype=dtype,
        use_cpu_kernels=use_cpu_kernels,
        use_triton_kernels=use_triton_kernels,
        device=device,
        sliding_window=sliding_window,
    )
    return ScratchPrefill(metadata, num_blocks)

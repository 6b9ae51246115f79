"""`scratch_prefill_metadata`: one whole prefill per sequence into contiguous scratch blocks."""

from __future__ import annotations

import pytest
import torch

from worker.engine.executor.layers.attention import scratch_prefill_metadata


def test_sequences_take_contiguous_blocks_in_order_and_every_token_a_slot_of_its_own() -> None:
    scratch = scratch_prefill_metadata([5, 16, 17], 16, num_queries_per_kv=1, dtype=torch.float32, device="cpu")
    assert scratch.num_blocks == 1 + 1 + 2
    metadata = scratch.metadata
    assert metadata.block_tables.tolist() == [[0, 0], [1, 0], [2, 3]]  # padded with 0
    assert metadata.positions.tolist() == list(range(5)) + list(range(16)) + list(range(17))
    assert metadata.slot_mapping.tolist() == list(range(5)) + list(range(16, 32)) + list(range(32, 49))
    assert metadata.query_lens_list == metadata.seq_lens_list == [5, 16, 17]


def test_an_empty_sequence_is_refused() -> None:
    with pytest.raises(ValueError):
        scratch_prefill_metadata([3, 0], 16, num_queries_per_kv=1, dtype=torch.float32, device="cpu")

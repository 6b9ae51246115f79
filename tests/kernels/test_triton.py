"""Parity of the Triton kernels (:mod:`kernels.triton_attention`) with their PyTorch twins (:mod:`kernels.reference`),
and of the attention twin with dense ``scaled_dot_product_attention``.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before the kernels are
imported), on tiny shapes in float32 and float16 (bfloat16 is not exact in the interpreter). With CUDA the same
tests run natively (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_attention = pytest.importorskip(
    "kernels.triton_attention", reason="triton is not installed (pip install triton==3.7.1, the `test` extra)"
)
import torch.nn.functional as F  # noqa: E402

from kernels import reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}
# Fault injection for scripts/gpu_check.sh's own test (tests/test_gpu_check.py): when set, the attention
# kernel's output is perturbed before it is compared, so that the check must report a mismatch.
INJECT_FAULT = os.environ.get("BATCHINFER_INJECT_KERNEL_FAULT") == "1"


def _make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    num_queries_per_kv: int,
    head_size: int,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    forced_block_id: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """A cache full of NaN except the batch's context (so a read outside it poisons the output), block tables
    of distinct shuffled blocks, and the query rows."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks or needed + 3
    block_ids = torch.randperm(num_blocks, generator=generator)[:needed]
    if forced_block_id is not None:
        block_ids[0] = forced_block_id
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    cursor = 0
    for seq_idx, count in enumerate(blocks_per_seq):
        block_tables[seq_idx, :count] = block_ids[cursor : cursor + count]
        cursor += count
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    for seq_idx, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots = block_tables[seq_idx].long()[positions // block_size] * block_size + positions % block_size
        key = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        reference.reshape_and_cache(key, value, kv_cache, slots)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * num_queries_per_kv, head_size, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, kv_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), block_tables


def _dense_attention(
    query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window=None, logits_soft_cap=None
) -> torch.Tensor:
    """Each sequence's context gathered into dense K/V, then one float32 SDPA with an explicit causal (and
    sliding-window) mask; with a soft-cap, the same in plain matrix products (SDPA has no soft-cap)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_queries_per_kv = query.shape[1] // num_kv_heads
    output = torch.empty(query.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        positions = torch.arange(seq_len)
        blocks = block_tables[seq_idx].long()[positions // block_size]
        keys = kv_cache[0][blocks, positions % block_size].float().repeat_interleave(num_queries_per_kv, dim=1)
        values = kv_cache[1][blocks, positions % block_size].float().repeat_interleave(num_queries_per_kv, dim=1)
        query_positions = torch.arange(seq_len - (end - start), seq_len)
        mask = positions[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] > query_positions[:, None] - sliding_window
        q, k, v = query[start:end].float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        if logits_soft_cap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            scores = torch.tanh(q @ k.transpose(1, 2) * scale / logits_soft_cap) * logits_soft_cap
            out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        output[start:end] = out.transpose(0, 1)
    return output


def _check_attention(query_lens, seq_lens, *, dtype, block_size=8, num_kv_heads=2, num_queries_per_kv=3,
                     head_size=16, num_kv_splits=None, sliding_window=None, logits_soft_cap=None,
                     **batch_kwargs) -> None:  # fmt: skip
    query, kv_cache, query_start_loc, seq_lens_t, block_tables = _make_batch(
        query_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_queries_per_kv=num_queries_per_kv,
        head_size=head_size,
        dtype=dtype,
        **batch_kwargs,
    )
    scale = head_size**-0.5
    num_tokens, num_heads = query.shape[:2]
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    dense = _dense_attention(query, kv_cache, query_start_loc, seq_lens_t, block_tables, scale, **options)
    if sliding_window is not None:
        # Blocks wholly before a sequence's first window are NaN (freed and reused): never read.
        for seq_idx, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
            first_visible = max(0, seq_len - query_len - sliding_window + 1)
            kv_cache[:, block_tables[seq_idx, : first_visible // block_size].long()] = float("nan")
    lse_twin = torch.empty(num_tokens, num_heads)
    twin = reference.paged_attention_reference(
        query, kv_cache, query_start_loc, seq_lens_t, block_tables, scale, lse_out=lse_twin, **options
    )
    torch.testing.assert_close(twin.float(), dense, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    lse = torch.full((num_tokens, num_heads), float("nan"), device=DEVICE)
    out = triton_attention.paged_attention_triton(
        query.to(DEVICE),
        kv_cache.to(DEVICE),
        query_start_loc.to(DEVICE),
        seq_lens_t.to(DEVICE),
        block_tables.to(DEVICE),
        scale,
        lse_out=lse,
        num_kv_splits=num_kv_splits,
        **options,
    )
    if INJECT_FAULT:
        out.view(-1)[0] += 0.5
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), twin.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(lse.cpu(), lse_twin, atol=1e-4, rtol=1e-4)


# (query_lens, seq_lens): odd lengths, contexts ending mid-block and on a block boundary.
BATCHES = {
    "decode": ([1, 1, 1], [1, 13, 24]),
    "extend": ([4, 2, 3], [21, 9, 16]),
    "prefill": ([7, 16, 1], [7, 16, 1]),
    "mixed": ([1, 5, 4, 1, 9], [17, 5, 27, 3, 9]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_paged_attention_matches_twin(kind: str, block_size: int, dtype: torch.dtype) -> None:
    query_lens, seq_lens = BATCHES[kind]
    _check_attention(query_lens, seq_lens, dtype=dtype, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "num_queries_per_kv"), [(3, 1), (1, 3), (2, 8)])
def test_paged_attention_grouped_query(num_kv_heads: int, num_queries_per_kv: int, dtype: torch.dtype) -> None:
    query_lens, seq_lens = BATCHES["mixed"]
    _check_attention(
        query_lens, seq_lens, dtype=dtype, num_kv_heads=num_kv_heads, num_queries_per_kv=num_queries_per_kv
    )


@pytest.mark.parametrize("head_size", [64, 128, 24])
def test_paged_attention_head_sizes(head_size: int) -> None:
    """The model head sizes, and one that is not a power of two (masked along the head dimension)."""
    _check_attention([1, 3], [11, 19], dtype=torch.float16, block_size=16, head_size=head_size, num_kv_heads=1)


def test_paged_attention_long_extend_spans_query_tiles() -> None:
    """More query rows than one program's tile: later tiles read further into the context."""
    _check_attention([1, 37], [6, 45], dtype=torch.float32, num_kv_heads=1, num_queries_per_kv=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("kind", "num_kv_splits"), [("decode", 3), ("mixed", 4), ("extend", 2)])
def test_split_kv_matches_twin(kind: str, num_kv_splits: int, dtype: torch.dtype) -> None:
    """Split-KV (flash-decoding): splits merged through their log-sum-exps, some of them empty for some rows
    (short sequences, rows whose causal bound ends before a split)."""
    query_lens, seq_lens = BATCHES[kind]
    _check_attention(query_lens, seq_lens, dtype=dtype, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "num_kv_splits"), [(1, None), (6, None), (11, 3), (100, None)])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_sliding_window_matches_twin(kind: str, window: int, num_kv_splits: int | None, dtype: torch.dtype) -> None:
    """Each row sees its last ``window`` positions; blocks before a sequence's first window hold NaN; with
    split-KV some splits lie wholly before the window. A window wider than the context changes nothing."""
    query_lens, seq_lens = BATCHES[kind]
    _check_attention(query_lens, seq_lens, dtype=dtype, sliding_window=window, num_kv_splits=num_kv_splits)


def test_sliding_window_long_extend_spans_query_tiles() -> None:
    """Later query tiles start their loop further into the context."""
    _check_attention([37], [45], dtype=torch.float32, num_kv_heads=1, num_queries_per_kv=1, sliding_window=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 7])
def test_logits_soft_cap_matches_twin(window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2's attention soft-cap (a small cap, so that tanh is far from linear on these scores)."""
    query_lens, seq_lens = BATCHES["mixed"]
    _check_attention(query_lens, seq_lens, dtype=dtype, sliding_window=window, logits_soft_cap=0.5)


def test_choose_num_kv_splits() -> None:
    assert triton_attention.choose_num_kv_splits(num_programs=200, max_seq_len=4096, num_sms=132) == 1
    assert triton_attention.choose_num_kv_splits(num_programs=8, max_seq_len=4096, num_sms=132) == 16
    assert triton_attention.choose_num_kv_splits(num_programs=8, max_seq_len=600, num_sms=132) == 2
    assert triton_attention.choose_num_kv_splits(num_programs=8, max_seq_len=100, num_sms=132) == 1


def test_paged_attention_block_id_above_2_16() -> None:
    """A block id past 2**16 (a cache of 2**16 + 8 blocks, ~34 MB in float16). Offsets past 2**31 elements would
    need a cache of several GB; the kernels widen block ids to int64 before any stride product for those."""
    _check_attention(
        [1, 3],
        [9, 12],
        dtype=torch.float16,
        num_kv_heads=1,
        num_blocks=2**16 + 8,
        forced_block_id=2**16 + 5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_matches_twin(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_size, block_size = 11, 3, 6, 4
    num_blocks = 2**16 + 4
    # K and V as strided views of a fused projection, float32 cast to the cache dtype on store.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_size, generator=generator)
    key, value = fused[:, 0], fused[:, 1]
    slot_mapping = torch.randperm(6 * block_size, generator=generator)[:num_tokens]
    slot_mapping[0] = (2**16 + 2) * block_size + 3
    twin_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    reference.reshape_and_cache(key.to(dtype), value.to(dtype), twin_cache, slot_mapping)
    cache = torch.zeros_like(twin_cache, device=DEVICE)
    triton_attention.reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), cache, slot_mapping.to(DEVICE))
    assert torch.equal(cache.cpu(), twin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_blocks_matches_twin(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    num_blocks = 2**16 + 4
    cache = torch.randn(2, num_blocks, 4, 1, 8, generator=generator).to(dtype)
    src = torch.tensor([3, 3, 2**16 + 1, 7])
    dst = torch.tensor([9, 2**16 + 3, 0, 5])
    twin_cache = cache.clone()
    reference.copy_blocks(twin_cache, src, dst)
    assert torch.equal(twin_cache[:, dst], cache[:, src])
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(twin_cache[:, untouched], cache[:, untouched])
    device_cache = cache.to(DEVICE)
    triton_attention.copy_blocks_triton(device_cache, src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(device_cache.cpu(), twin_cache)


def test_copy_blocks_twin_reads_the_cache_before_the_call() -> None:
    cache = torch.arange(2 * 4 * 2, dtype=torch.float32).view(2, 4, 2, 1, 1)
    original = cache.clone()
    reference.copy_blocks(cache, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert torch.equal(cache[:, 1], original[:, 0]) and torch.equal(cache[:, 2], original[:, 1])


def test_paged_attention_rejects_bad_inputs() -> None:
    query, kv_cache, query_start_loc, seq_lens, block_tables = _make_batch(
        [1], [5], block_size=8, num_kv_heads=1, num_queries_per_kv=1, head_size=16, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="dtype"):
        triton_attention.paged_attention_triton(query.half(), kv_cache, query_start_loc, seq_lens, block_tables, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        bad = torch.zeros(2, 2, 6, 1, 16)
        triton_attention.paged_attention_triton(query, bad, query_start_loc, seq_lens, block_tables, 0.25)


@pytest.mark.parametrize(
    "kv_cache_dtype,head_size,num_groups", [("int8", 16, 1), ("int8", 64, 2), ("fp8_e4m3", 16, 1), ("fp8_e4m3", 64, 1)]
)
def test_quantized_store_and_attention_match_twin(kv_cache_dtype: str, head_size: int, num_groups: int) -> None:
    """The quantizing store gives the twin's elements and scales, int8's one per group of 32 channels (the whole
    head below 32; the second group of keys 20x the first so each needs its own), fp8's one a head; attention over those blocks (read
    in place, scales applied in the kernel) gives the twin's output; block copies carry the scales."""
    generator = torch.Generator().manual_seed(4)
    query_lens, seq_lens = [1, 5, 1, 9], [13, 5, 24, 20]
    num_kv_heads, num_queries_per_kv, block_size = 2, 3, 8
    query, float_cache, query_start_loc, seq_lens_t, block_tables = _make_batch(
        query_lens, seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_queries_per_kv=num_queries_per_kv, head_size=head_size, dtype=torch.float32,
    )  # fmt: skip
    float_cache = torch.nan_to_num(float_cache, nan=0.0)
    float_cache[0, ..., 32:] *= 20
    num_slots = float_cache.shape[1] * block_size
    fused = float_cache.view(2, num_slots, num_kv_heads, head_size)
    slot_mapping = torch.randperm(num_slots, generator=generator)
    twin_data, twin_scales = reference.quantize_kv(float_cache, kv_cache_dtype)
    assert twin_scales.shape == (*float_cache.shape[:4], num_groups)
    storage = reference.KV_STORAGE_DTYPES[kv_cache_dtype]
    data = torch.zeros(float_cache.shape, dtype=storage, device=DEVICE)
    scales = torch.zeros(twin_scales.shape, device=DEVICE)
    triton_attention.reshape_and_cache_triton(
        fused[0, slot_mapping].to(DEVICE), fused[1, slot_mapping].to(DEVICE), data, slot_mapping.to(DEVICE),
        kv_scales=scales,
    )  # fmt: skip
    torch.testing.assert_close(scales.cpu(), twin_scales, atol=0, rtol=0)
    if kv_cache_dtype == "int8" or DEVICE == "cuda":
        assert torch.equal(data.cpu().view(torch.uint8), twin_data.view(torch.uint8))
    else:
        # NOTE: the interpreter's float32 -> float8 cast drops the carry of a mantissa that rounds up to the
        # next power of two (31.7 -> 16, not 32); the GPU's conversion instruction rounds to nearest even.
        data = twin_data.to(DEVICE)

    scale = head_size**-0.5
    args = (query_start_loc, seq_lens_t, block_tables, scale)
    twin = reference.paged_attention_reference(query, twin_data, *args, kv_scales=twin_scales)
    device_args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]
    out = triton_attention.paged_attention_triton(query.to(DEVICE), data, *device_args, kv_scales=scales)
    torch.testing.assert_close(out.cpu(), twin, atol=2e-5, rtol=2e-5)

    src, dst = torch.tensor([0, 1]), torch.tensor([2, 3])
    triton_attention.copy_blocks_triton(scales, src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(scales[:, dst].cpu(), twin_scales[:, src])
    with pytest.raises(ValueError, match="kv_scales"):
        triton_attention.paged_attention_triton(query.to(DEVICE), data, *device_args)
    with pytest.raises(ValueError, match="kv_scales"):  # the per-head layout of before
        triton_attention.paged_attention_triton(query.to(DEVICE), data, *device_args, kv_scales=scales[..., 0])

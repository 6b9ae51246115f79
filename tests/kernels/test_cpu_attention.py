"""The C++ CPU paged-attention kernel against its plain PyTorch twin (kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.cpu_attention import paged_attention_cpu
from kernels.cpu_extension import cpu_kernels_available
from kernels.reference import paged_attention_reference, quantize_kv, reshape_and_cache

NUM_BLOCKS = 400
HEAD_SIZE = 64

# (query_len, seq_len) per sequence, in batch order.
DECODE = [(1, 5), (1, 17), (1, 1), (1, 33), (1, 16), (1, 250)]
PREFILL = [(7, 7), (13, 13), (3, 3), (1, 1), (16, 16)]
MIXED = [(1, 9), (5, 12), (1, 20), (16, 16), (4, 30), (1, 2), (2, 2)]  # prefix-cached chunks among decodes
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _setup(batch, num_heads, num_kv_heads, block_size, seed=0):
    """Paged cache with each context in shuffled blocks, every unused slot full of large values."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE, generator=gen) * 1e4
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    block_tables = []
    for _, seq_len in batch:
        num_blocks = -(-seq_len // block_size)
        block_tables.append(block_ids[:num_blocks])
        del block_ids[:num_blocks]
    width = max(len(table) for table in block_tables) + 2  # padding columns point at a garbage block
    tables = torch.tensor([table + [block_ids[0]] * (width - len(table)) for table in block_tables], dtype=torch.int32)
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for (_, seq_len), table in zip(batch, block_tables)
        for pos in range(seq_len)
    ]
    reshape_and_cache(
        torch.randn(len(slots), num_kv_heads, HEAD_SIZE, generator=gen),
        torch.randn(len(slots), num_kv_heads, HEAD_SIZE, generator=gen),
        kv_cache,
        torch.tensor(slots),
    )
    query_lens = [q for q, _ in batch]
    query_start_loc = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in batch], dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_heads, HEAD_SIZE, generator=gen) * 3
    return query, kv_cache, query_start_loc, seq_lens, tables


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (6, 1)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_kernel_matches_reference(kind, num_heads, num_kv_heads, block_size):
    args = _setup(BATCHES[kind], num_heads, num_kv_heads, block_size)
    scale = HEAD_SIZE**-0.5

    out = paged_attention_cpu(*args, scale)

    torch.testing.assert_close(out, paged_attention_reference(*args, scale), atol=2e-5, rtol=1e-5)


def test_strided_query_view_and_two_threads():
    """A query sliced out of a fused QKV tensor (the model's layout) works, and threads split the work."""
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(MIXED, 9, 3, 16, seed=3)
    fused = torch.cat([query, torch.randn(query.shape[0], 6, HEAD_SIZE)], dim=1)
    strided = fused[:, :9]
    assert not strided.is_contiguous()
    torch.set_num_threads(2)

    out = paged_attention_cpu(strided, kv_cache, query_start_loc, seq_lens, tables, 0.125)

    expected = paged_attention_reference(query, kv_cache, query_start_loc, seq_lens, tables, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_kernel_log_sum_exp_matches_reference(kind):
    """The optional LSE output (for merging partial attentions) is each row's log-sum-exp of scaled scores."""
    args = _setup(BATCHES[kind], 9, 3, 4, seed=4)
    num_tokens = args[0].shape[0]
    lse, expected_lse = torch.full((num_tokens, 9), float("nan")), torch.empty(num_tokens, 9)

    out = paged_attention_cpu(*args, 0.125, lse_out=lse)

    expected = paged_attention_reference(*args, 0.125, lse_out=expected_lse)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


def test_extreme_scores_stay_finite():
    """One dominant key (scores ~1e4 apart) gives its value exactly; no overflow, no NaN."""
    query, kv_cache, query_start_loc, seq_lens, tables = _setup([(1, 40)], 3, 3, 4, seed=5)
    query *= 1e3

    out = paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, 1.0)

    assert torch.isfinite(out).all()
    expected = paged_attention_reference(query, kv_cache, query_start_loc, seq_lens, tables, 1.0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_bad_block_id_raises():
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(DECODE, 4, 4, 4)
    tables[1, 0] = NUM_BLOCKS

    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, 0.125)


def test_query_longer_than_context_raises():
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(PREFILL, 4, 4, 4)
    seq_lens[0] = 6  # the first sequence has 7 query tokens

    with pytest.raises(RuntimeError, match="query_len <= seq_len"):
        paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, 0.125)


def test_env_var_disables_kernel(monkeypatch):
    monkeypatch.setenv(cpu_extension.DISABLE_ENV, "0")

    assert not cpu_kernels_available()


@pytest.mark.parametrize("kernels_env", ["1", "0"])
def test_engine_path_dispatches_decode_rows(monkeypatch, kernels_env):
    """paged_attention_forward sends decode rows of a mixed batch to the kernel (unless disabled); same output."""
    from worker.engine.executor.layers.attention import build_attention_metadata, paged_attention_forward

    monkeypatch.setenv(cpu_extension.DISABLE_ENV, kernels_env)
    query, kv_cache, _, _, _ = _setup(MIXED, 9, 3, 4, seed=7)
    gen = torch.Generator().manual_seed(8)
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    block_tables = []
    for _, seq_len in MIXED:
        block_tables.append(block_ids[: -(-seq_len // 4)])
        del block_ids[: -(-seq_len // 4)]
    metadata = build_attention_metadata(
        [q for q, _ in MIXED], [s for _, s in MIXED], block_tables, 4, num_queries_per_kv=3
    )
    key = torch.randn(query.shape[0], 3, HEAD_SIZE, generator=gen)
    value = torch.randn(query.shape[0], 3, HEAD_SIZE, generator=gen)
    expected_cache = kv_cache.clone()
    reshape_and_cache(key, value, expected_cache, metadata.slot_mapping)
    expected = paged_attention_reference(
        query, expected_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, 0.125
    )

    out = paged_attention_forward(query, key, value, kv_cache, metadata, 0.125)

    assert (metadata.plan.kernel is not None) == (kernels_env == "1")
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(kv_cache, expected_cache)


@pytest.mark.parametrize("window", [1, 5, 8, 23])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_sliding_window_reads_only_the_window(kind, window):
    """Each token sees its last ``window`` positions; blocks wholly before the first query's window are NaN
    (as if returned to the pool and reused) and must not be read."""
    block_size = 4
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(BATCHES[kind], 6, 2, block_size, seed=9)
    for seq, (query_len, seq_len) in enumerate(BATCHES[kind]):
        first_visible = max(0, seq_len - query_len - window + 1)
        kv_cache[:, tables[seq, : first_visible // block_size].long()] = float("nan")

    out = paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, 0.125, sliding_window=window)

    expected = paged_attention_reference(
        query, kv_cache, query_start_loc, seq_lens, tables, 0.125, sliding_window=window
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_sliding_window_wider_than_the_context_is_full_attention():
    args = _setup(MIXED, 6, 2, 4, seed=10)

    out = paged_attention_cpu(*args, 0.125, sliding_window=1000)

    torch.testing.assert_close(out, paged_attention_reference(*args, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_logits_soft_cap_matches_reference(window):
    """Scores of a few tens soft-capped at 5 (far from linear), with and without a window; LSE of the capped scores."""
    args = _setup(MIXED, 6, 2, 4, seed=11)
    num_tokens = args[0].shape[0]
    lse, expected_lse = torch.empty(num_tokens, 6), torch.empty(num_tokens, 6)

    out = paged_attention_cpu(*args, 1.0, lse_out=lse, sliding_window=window, logits_soft_cap=5.0)

    expected = paged_attention_reference(*args, 1.0, lse_out=expected_lse, sliding_window=window, logits_soft_cap=5.0)
    uncapped = paged_attention_reference(*args, 1.0, sliding_window=window)
    assert not torch.allclose(expected, uncapped, atol=1e-2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 4), (6, 1, 16)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_quantized_cache_matches_reference(kind, num_heads, num_kv_heads, block_size, kv_cache_dtype):
    """int8 / fp8 blocks read in place with their per-(token, head) scales: the reference over the same
    quantized blocks, to float32 rounding; and close to the unquantized attention."""
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(BATCHES[kind], num_heads, num_kv_heads, block_size)
    data, scales = quantize_kv(kv_cache / 1e2, kv_cache_dtype)  # the garbage slots stay large but finite
    scale = HEAD_SIZE**-0.5
    lse, expected_lse = torch.empty(query.shape[:2]), torch.empty(query.shape[:2])

    out = paged_attention_cpu(query, data, query_start_loc, seq_lens, tables, scale, lse, kv_scales=scales)

    expected = paged_attention_reference(
        query, data, query_start_loc, seq_lens, tables, scale, expected_lse, kv_scales=scales
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=1e-5)
    exact = paged_attention_reference(query, kv_cache / 1e2, query_start_loc, seq_lens, tables, scale)
    torch.testing.assert_close(out, exact, atol=0.15 if kv_cache_dtype == "fp8_e4m3" else 0.02, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 4), (6, 1, 16)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_bfloat16_cache_and_query_match_reference(kind, num_heads, num_kv_heads, block_size):
    """A bfloat16 model's cache and query: the float32 reference over the same (widened) values, its result
    rounded to bfloat16 once, up to a unit in the last place of bfloat16; the lse to float32 rounding."""
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(BATCHES[kind], num_heads, num_kv_heads, block_size)
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    scale = HEAD_SIZE**-0.5
    lse, expected_lse = torch.empty(query.shape[:2]), torch.empty(query.shape[:2])

    out = paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, scale, lse)

    expected = paged_attention_reference(
        query.float(), kv_cache.float(), query_start_loc, seq_lens, tables, scale, expected_lse
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-5, rtol=2**-8)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 4), (6, 1, 16), (4, 4, 1)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_bfloat16_query_gives_the_bits_of_float32_io(kind, num_heads, num_kv_heads, block_size, threads):
    """A bfloat16 query (here a strided view, as of a fused QKV projection) is widened and the output rounded
    inside the kernel: the same bits as the float32 call on the widened query, rounded with ``.to``, whatever the
    split of a token's KV heads over threads."""
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(BATCHES[kind], num_heads, num_kv_heads, block_size)
    fused = torch.cat([query, query[:, :1]], dim=1).bfloat16()  # one more head: query is a strided view of it
    query, kv_cache = fused[:, :num_heads], kv_cache.bfloat16()
    scale = HEAD_SIZE**-0.5
    lse, float_lse = torch.empty(query.shape[:2]), torch.empty(query.shape[:2])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, scale, lse)
        float_out = paged_attention_cpu(query.float(), kv_cache, query_start_loc, seq_lens, tables, scale, float_lse)
    finally:
        torch.set_num_threads(previous)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out.view(torch.int16), float_out.bfloat16().view(torch.int16))
    assert torch.equal(lse, float_lse)


def test_query_and_out_dtypes_must_agree():
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(DECODE, 4, 4, 4)
    out = torch.empty(query.shape, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.batchinfer_cpu.paged_attention_(
            out, query.bfloat16(), kv_cache.bfloat16(), query_start_loc, seq_lens, tables, 0.125
        )


def test_bfloat16_cache_takes_no_scales():
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(DECODE, 4, 4, 4)
    scales = torch.ones(kv_cache.shape[:4])
    with pytest.raises(RuntimeError, match="kv_scales"):
        paged_attention_cpu(query, kv_cache.bfloat16(), query_start_loc, seq_lens, tables, 0.125, kv_scales=scales)


def test_quantized_cache_needs_its_scales():
    query, kv_cache, query_start_loc, seq_lens, tables = _setup(DECODE, 4, 4, 4)
    data, scales = quantize_kv(kv_cache, "int8")
    with pytest.raises(RuntimeError, match="kv_scales"):
        paged_attention_cpu(query, data, query_start_loc, seq_lens, tables, 0.125)
    with pytest.raises(RuntimeError, match="kv_scales"):
        paged_attention_cpu(query, kv_cache, query_start_loc, seq_lens, tables, 0.125, kv_scales=scales)

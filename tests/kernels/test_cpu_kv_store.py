"""The C++ quantize-on-store of a quantized KV cache against its PyTorch twin (kernels/reference.py:quantize_kv), and
the plain store of a float32 or bfloat16 cache against the indexed copies it replaces."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_kv_store import kv_store_cpu, quantize_kv_store_cpu
from kernels.reference import KV_STORAGE_DTYPES, dequantize_kv, kv_num_scale_groups, quantize_kv

pytestmark = pytest.mark.usefixtures("cpu_kernels")

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 6, 4, 3, 64


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_store_equals_reference_bytes_and_scales(kv_cache_dtype):
    """Same bytes and scales as quantize_kv plus indexed copies, on strided views of a fused QKV output, with an
    all-zero row, an all-zero group beside a nonzero one, a row past the fp8 range, a group 100x its neighbour
    and ties of int8 rounding; other slots untouched; stored rows equal the dequantized twin; each int8 group
    (channels 0..31, 32..63) has its own scale, fp8 one a head."""
    num_groups = kv_num_scale_groups(HEAD_SIZE, kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    num_tokens = 7
    qkv = torch.randn(num_tokens, 5, NUM_KV_HEADS, HEAD_SIZE, generator=gen) * 3
    key, value = qkv[:, 3], qkv[:, 4]  # unit last stride, not contiguous
    key[2, 1] = 0.0
    key[3, 0, 32:] = 0.0
    key[6, 2, 32:] *= 100
    value[4, 0] *= 1e3
    value[5, 2, :3] = torch.tensor([127.0, 0.5, -1.5])  # scale 1: y = 0.5 and -1.5 are ties
    slots = torch.tensor([3, 0, 17, 9, 22, 5, 12])
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS)
    data = torch.full((*shape, HEAD_SIZE), 7, dtype=torch.uint8).view(KV_STORAGE_DTYPES[kv_cache_dtype])
    scales = torch.full((*shape, num_groups), -1.0)
    expected_data, expected_scales = data.clone(), scales.clone()

    stored = quantize_kv_store_cpu(data, scales, key, value, slots, return_stored=True)

    assert stored is not None
    for half, x in enumerate((key, value)):
        q, s = quantize_kv(x, kv_cache_dtype)
        expected_data.view(torch.uint8)[half].view(-1, NUM_KV_HEADS, HEAD_SIZE)[slots] = q.view(torch.uint8)
        expected_scales[half].view(-1, NUM_KV_HEADS, num_groups)[slots] = s
        assert torch.equal(stored[half], dequantize_kv(q, s))
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    key_scales = scales[0].view(-1, NUM_KV_HEADS, num_groups)
    if kv_cache_dtype == "int8":
        assert key_scales[slots[3], 0].tolist() == [(key[3, 0, :32].abs().max() / 127).item(), 1.0]  # zero group: 1
        small, big = key_scales[slots[6], 2].tolist()
        assert big > 50 * small
    else:
        assert key_scales[slots[6], 2].tolist() == [(key[6, 2].abs().max() / 448).item()]
    assert quantize_kv_store_cpu(data, scales, key, value, slots) is None


def test_store_rejects_bad_slots_and_dtypes():
    data = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.int8)
    scales = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_SIZE)
    with pytest.raises(RuntimeError, match="out of range"):
        quantize_kv_store_cpu(data, scales, key, key, torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE]))
    with pytest.raises(RuntimeError, match="float32"):
        quantize_kv_store_cpu(data, scales, key.double(), key, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="data must be"):
        quantize_kv_store_cpu(data.float(), scales, key, key, torch.tensor([0, 1]))
    for bad in (scales[..., 0], torch.zeros(*scales.shape[:4], 3)):  # the per-head layout; groups not dividing 64
        with pytest.raises(RuntimeError, match="scales must be"):
            quantize_kv_store_cpu(data, bad.contiguous(), key, key, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_apart", [False, True])
def test_plain_store_equals_the_indexed_copies(dtype, heads_apart):
    """Rows at their slots as index_copy_ puts them (the twin), from strided views of a fused QKV output (K heads
    side by side, or one head apart), other slots untouched; a slot out of range or another dtype raises."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = 9
    qkv = torch.randn(num_tokens, 4 * NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    if heads_apart:
        key, value = qkv[:, 0::4][:, :NUM_KV_HEADS], qkv[:, 1::4][:, :NUM_KV_HEADS]
    else:
        key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS : 2 * NUM_KV_HEADS]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    want = cache.clone()
    flat = want.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)
    kv_store_cpu(cache, key, value, slots)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="out of range"):
        kv_store_cpu(cache, key[:1], value[:1], torch.tensor([NUM_BLOCKS * BLOCK_SIZE]))
    with pytest.raises(RuntimeError):
        kv_store_cpu(cache, key.double(), value.double(), slots)

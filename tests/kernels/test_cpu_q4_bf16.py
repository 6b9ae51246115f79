"""The bfloat16-activation Q4 linear layer (kernels/cpu_q4_bf16.cpp, AVX512_BF16) against its float64 twin
(kernels/reference.py), its packed layout, its batch invariance (within each range of heights by default, at every
height with ``batch_invariant``), the fused decoder-layer ops' use of the flag, and its refusals.

Blocks come from the ``gguf`` package's own quantizers, so the layout is ggml's. In calls of up to 24 rows (or any
height with ``batch_invariant``) the kernel's weights and activations enter its products exactly (integer quants,
bfloat16 activations), so it differs from the exact float64 result only by float32 rounding in its sums before the
one rounding to bfloat16: each output must be within one bfloat16 unit of the exact value (one of its two bfloat16
neighbours), plus float32 rounding of the sum's terms where the sum nearly cancels. Taller calls without the flag run
on the weights dequantized and rounded to bfloat16
(``round_bf16(d (q - 8))``, ``round_bf16(d q + m)``): the same bound holds against the float64 result over those
weights, and the output is the packed bfloat16 kernel's over them, bit for bit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu_elementwise import (
    add_rms_norm_cpu,
    decoder_attention_input_cpu,
    decoder_attention_output_mlp_cpu,
    gguf_bf16_kind,
    rms_norm_cpu,
    rotary_embedding_cpu_,
    silu_and_mul_cpu,
)
from kernels.cpu_extension import cpu_flags
from kernels.cpu_gemm import linear_packed_bf16, pack_linear_weight_bf16
from kernels.cpu_q4 import gguf_bf16_supported, gguf_pack_bf16, linear_gguf_bf16
from kernels.reference import GGUF_BF16_EXACT_ROWS, dequantize_gguf_blocks, linear_gguf_bf16_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")

needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the CPU has no AVX512_BF16")
TYPES = {"Q4_0": 2, "Q4_1": 3}


def _blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(blocks))


def _assert_within_one_bf16_unit(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias):
    weight = weight.double()
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.abs().T
    unit = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    error = (out.double() - exact).abs()
    assert (error <= unit + 2**-20 * magnitude).all(), (error - unit).max()


def test_supported_exactly_when_the_cpu_has_avx512_bf16():
    assert gguf_bf16_supported() == ("avx512_bf16" in cpu_flags())


@pytest.mark.skipif("avx512_bf16" in cpu_flags(), reason="the CPU has AVX512_BF16")
def test_refused_without_avx512_bf16():
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        gguf_pack_bf16(_blocks("Q4_1", 32, 32), 3, 32)


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
def test_pack_layout_puts_pairs_of_inputs_per_column_with_the_scales_after(type_name):
    block_type, out_features, in_features = TYPES[type_name], 37, 64
    blocks = _blocks(type_name, out_features, in_features)

    packed = gguf_pack_bf16(blocks, block_type, in_features)

    per_block = 640 if block_type == 3 else 576
    assert packed.shape == (2, 2, per_block) and packed.dtype == torch.uint8
    raw = blocks.reshape(out_features, 2, 20 if block_type == 3 else 18)
    quants = raw[..., 4:] if block_type == 3 else raw[..., 2:]
    nibbles = torch.cat((quants & 0x0F, quants >> 4), dim=-1)  # [n, block, k]
    for n in range(out_features):
        panel, c = divmod(n, 32)
        for b in range(2):
            for k in range(32):
                byte = packed[panel, b, (k // 2) * 32 + (c % 16) * 2 + k % 2]
                got = byte & 0x0F if c < 16 else byte >> 4
                assert got == nibbles[n, b, k]
            assert torch.equal(packed[panel, b, 512 + 2 * c : 514 + 2 * c], raw[n, b, :2])  # d
            if block_type == 3:
                assert torch.equal(packed[panel, b, 576 + 2 * c : 578 + 2 * c], raw[n, b, 2:4])  # m
    assert torch.count_nonzero(packed[1, :, 512 + 2 * 5 : 576]) == 0  # columns past out_features are zero


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("num_rows", [0, 1, 5, 6, 7, 13, 24])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 96), (64, 32), (960, 576), (70, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_up_to_24_rows_match_the_exact_result_within_one_bfloat16_unit(
    type_name, num_rows, out_features, in_features, with_bias
):
    block_type = TYPES[type_name]
    blocks = _blocks(type_name, out_features, in_features)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None

    out = linear_gguf_bf16(x, gguf_pack_bf16(blocks, block_type, in_features), block_type, out_features, bias)

    assert out.shape == (num_rows, out_features) and out.dtype == torch.bfloat16 and out.is_contiguous()
    _assert_within_one_bf16_unit(out, x, dequantize_gguf_blocks(blocks, block_type), bias)
    twin = linear_gguf_bf16_reference(x, blocks, block_type, bias)
    # The twin rounds the exact value once: the kernel equals it except where its float32 sum sits on the other
    # side of a bfloat16 rounding boundary (a small fraction of outputs).
    assert (out != twin).sum() <= 0.05 * out.numel()


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("num_rows", [25, 26, 36, 37, 49, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 96), (64, 32), (960, 576), (70, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_more_than_24_rows_run_the_packed_bf16_kernel_over_the_bf16_rounded_weights(
    type_name, num_rows, out_features, in_features, threads
):
    torch.set_num_threads(threads)
    block_type = TYPES[type_name]
    blocks = _blocks(type_name, out_features, in_features)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    weight = dequantize_gguf_blocks(blocks, block_type).bfloat16()  # round to nearest even, as the kernel

    out = linear_gguf_bf16(x, gguf_pack_bf16(blocks, block_type, in_features), block_type, out_features, bias)

    assert num_rows > GGUF_BF16_EXACT_ROWS
    _assert_within_one_bf16_unit(out, x, weight, bias)
    assert torch.equal(out, linear_packed_bf16(x, pack_linear_weight_bf16(weight), out_features, bias))
    twin = linear_gguf_bf16_reference(x, blocks, block_type, bias)
    assert (out != twin).sum() <= 0.05 * out.numel()


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
def test_more_than_24_rows_dequantize_each_weight_to_its_nearest_bfloat16(type_name):
    # Identity rows read the weights back: every nibble and many float16 d (and m) whose product or sum sits
    # between two bfloat16 values or on a tie; the float32 value rounded to nearest even, as torch rounds it.
    block_type, in_features = TYPES[type_name], 64
    blocks = _blocks(type_name, 50, in_features, seed=3)
    eye = torch.eye(in_features).bfloat16()

    out = linear_gguf_bf16(eye, gguf_pack_bf16(blocks, block_type, in_features), block_type, 50)

    weight = dequantize_gguf_blocks(blocks, block_type)
    assert torch.equal(out.T, weight.bfloat16())
    assert not torch.equal(out.T.float(), weight)  # the rounding happened


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
def test_batch_invariant_bit_for_bit_within_each_range_of_heights(type_name):
    block_type = TYPES[type_name]
    blocks = _blocks(type_name, 100, 576)
    packed = gguf_pack_bf16(blocks, block_type, 576)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).bfloat16()

    tall, short = linear_gguf_bf16(x, packed, block_type, 100), linear_gguf_bf16(x[:24], packed, block_type, 100)

    for rows in (slice(0, 25), slice(20, 70), slice(45, 70)):  # more than 24 rows: the dequantized weights
        assert torch.equal(linear_gguf_bf16(x[rows], packed, block_type, 100), tall[rows])
    for rows in ([0], [3, 4], slice(5, 12), slice(1, 24)):  # up to 24: the exact quants
        assert torch.equal(linear_gguf_bf16(x[rows], packed, block_type, 100), short[rows])
    # Across the two a row's bits can differ (documented, docs/engine.md "Batch-invariant numerics").
    assert not torch.equal(short, tall[:24])


@needs_bf16
@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("num_rows", [40, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 1536), (100, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariant_gives_every_row_of_a_tall_call_its_bits_alone(
    type_name, num_rows, out_features, in_features, threads
):
    torch.set_num_threads(threads)
    block_type = TYPES[type_name]
    blocks = _blocks(type_name, out_features, in_features)
    packed = gguf_pack_bf16(blocks, block_type, in_features)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()

    tall = linear_gguf_bf16(x, packed, block_type, out_features, bias, batch_invariant=True)

    for r in range(num_rows):  # the exact chain: the bits of the row alone (a 1-row call, registers' expansion)
        assert torch.equal(tall[r], linear_gguf_bf16(x[r : r + 1], packed, block_type, out_features, bias)[0]), r
    for rows in (slice(0, 24), slice(7, 31), slice(3, num_rows)):  # and of any other height, flagged or not
        assert torch.equal(linear_gguf_bf16(x[rows], packed, block_type, out_features, bias, True), tall[rows])
    _assert_within_one_bf16_unit(tall, x, dequantize_gguf_blocks(blocks, block_type), bias)
    twin = linear_gguf_bf16_reference(x, blocks, block_type, bias, batch_invariant=True)
    assert (tall != twin).sum() <= 0.05 * tall.numel()
    # Without the flag the same call runs on the bfloat16-rounded weights: other bits.
    assert not torch.equal(linear_gguf_bf16(x, packed, block_type, out_features, bias), tall)


@needs_bf16
def test_the_fused_decoder_layer_ops_pass_the_flag_to_the_q4_panels():
    hidden, heads, head_size, intermediate, num_tokens = 128, 4, 32, 256, 40
    gen = torch.Generator().manual_seed(5)
    panels = {}
    for name, (out_features, in_features) in {
        "qkv": (3 * hidden, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }.items():
        panels[name] = (
            gguf_pack_bf16(_blocks("Q4_1", out_features, in_features, seed=len(panels)), 3, in_features),
            out_features,
        )
    kind = gguf_bf16_kind(3)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    attn = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    norm = torch.rand(hidden, generator=gen) + 0.5
    positions = torch.arange(num_tokens)
    angles = torch.arange(64)[:, None] * torch.rand(head_size // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()

    def linear(name, rows, batch_invariant):
        weight, out_features = panels[name]
        return linear_gguf_bf16(rows, weight, 3, out_features, None, batch_invariant)

    for batch_invariant in (False, True):
        qkv = decoder_attention_input_cpu(
            x,
            norm,
            1e-5,
            panels["qkv"][0],
            kind,
            3 * hidden,
            None,
            positions,
            cos,
            sin,
            2 * heads,
            head_size,
            batch_invariant,
        )
        want_qkv = linear("qkv", rms_norm_cpu(x, norm, 1e-5), batch_invariant)
        rotary_embedding_cpu_(want_qkv.view(num_tokens, -1, head_size)[:, : 2 * heads], positions, cos, sin)
        assert torch.equal(qkv, want_qkv), batch_invariant
        out = decoder_attention_output_mlp_cpu(
            attn,
            x,
            panels["o"][0],
            kind,
            None,
            norm,
            1e-5,
            panels["gate_up"][0],
            kind,
            2 * intermediate,
            None,
            panels["down"][0],
            kind,
            None,
            batch_invariant,
        )
        total, normed = add_rms_norm_cpu(x, linear("o", attn, batch_invariant), norm, 1e-5)
        want = total + linear("down", silu_and_mul_cpu(linear("gate_up", normed, batch_invariant)), batch_invariant)
        assert torch.equal(out, want), batch_invariant
        if batch_invariant:  # every row as alone: the first row of a 1-row call
            assert torch.equal(
                qkv[:1],
                decoder_attention_input_cpu(
                    x[:1],
                    norm,
                    1e-5,
                    panels["qkv"][0],
                    kind,
                    3 * hidden,
                    None,
                    positions[:1],
                    cos,
                    sin,
                    2 * heads,
                    head_size,
                ),
            )
        else:
            unflagged = (qkv, out)
    assert not torch.equal(unflagged[0], qkv) and not torch.equal(unflagged[1], out)


@needs_bf16
def test_strided_rows_and_leading_dimensions():
    blocks = _blocks("Q4_1", 40, 64)
    packed = gguf_pack_bf16(blocks, 3, 64)
    x = torch.randn(9, 100).bfloat16()[:, 3:67]
    x3 = torch.randn(2, 7, 64).bfloat16()
    assert not x.is_contiguous()

    out, out3 = linear_gguf_bf16(x, packed, 3, 40), linear_gguf_bf16(x3, packed, 3, 40)

    assert torch.equal(out, linear_gguf_bf16(x.contiguous(), packed, 3, 40))
    assert out3.shape == (2, 7, 40)
    assert torch.equal(out3.reshape(14, 40), linear_gguf_bf16(x3.reshape(14, 64), packed, 3, 40))


@needs_bf16
def test_refuses_other_block_types_and_mismatched_inputs():
    blocks = _blocks("Q4_1", 32, 64)
    with pytest.raises(RuntimeError, match="block type 8 has no bfloat16 kernel"):
        gguf_pack_bf16(_blocks("Q8_0", 32, 64), 8, 64)
    with pytest.raises(RuntimeError, match="multiple of the block size 32"):
        gguf_pack_bf16(blocks, 3, 48)
    packed = gguf_pack_bf16(blocks, 3, 64)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        linear_gguf_bf16(torch.randn(2, 64), packed, 3, 32)
    with pytest.raises(RuntimeError, match="gguf_pack_bf16"):
        linear_gguf_bf16(torch.randn(2, 96).bfloat16(), packed, 3, 32)
    with pytest.raises(RuntimeError, match="gguf_pack_bf16"):
        linear_gguf_bf16(torch.randn(2, 64).bfloat16(), packed, 2, 32)

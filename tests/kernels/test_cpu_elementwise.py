"""The fused elementwise C++ kernels against their PyTorch expressions, and their batch invariance."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu_elementwise import (
    add_layer_norm_cpu,
    add_rms_norm_cpu,
    bias_gelu_cpu_,
    rms_norm_cpu,
    rotary_embedding_cpu_,
    silu_and_mul_cpu,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _reference_rms_norm(x, weight, eps, unit_offset):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1.0 + weight) if unit_offset else weight * normed


@pytest.mark.parametrize("width", [1, 15, 64, 576, 1000])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_the_torch_expression(width, unit_offset):
    x, weight = _randn(37, width, scale=3.0), _randn(width, seed=1)

    out = rms_norm_cpu(x, weight, 1e-5, unit_offset)

    torch.testing.assert_close(out, _reference_rms_norm(x, weight, 1e-5, unit_offset), atol=1e-5, rtol=1e-5)


def test_rms_norm_keeps_leading_dimensions_and_reads_strided_rows():
    wide, weight = _randn(4, 9, 80), _randn(64, seed=1)
    x = wide[..., 8:72]
    assert not x.is_contiguous()

    out = rms_norm_cpu(x, weight, 1e-6)

    assert out.shape == (4, 9, 64)
    torch.testing.assert_close(out, _reference_rms_norm(x, weight, 1e-6, False), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_returns_the_sum_and_its_norm():
    x, delta, weight = _randn(21, 576), _randn(21, 576, seed=1), _randn(576, seed=2)

    total, normed = add_rms_norm_cpu(x, delta, weight, 1e-5)

    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, _reference_rms_norm(x + delta, weight, 1e-5, False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [1, 7, 13, 16, 1536])  # 8-wide vectors, their tail, both
def test_silu_and_mul_matches_the_torch_expression(width):
    gate_up = _randn(13, 2 * width, scale=4.0)
    gate_up[0, :width] = torch.linspace(-200.0, 200.0, width)  # beyond exp's range on both sides

    out = silu_and_mul_cpu(gate_up)

    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def _reference_rotary(x, positions, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[positions][:, None, :] + rotated * sin[positions][:, None, :]


def _tables(max_positions, head_size):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_rotary_embedding_rotates_a_view_of_a_fused_projection_in_place():
    cos, sin = _tables(512, 64)
    qkv = _randn(11, 9 + 3 + 3, 64)
    positions = torch.tensor([0, 5, 511, 3, 3, 100, 7, 8, 9, 200, 1])
    qk = qkv[:, :12]
    expected = _reference_rotary(qk.clone(), positions, cos, sin)
    value = qkv[:, 12:].clone()

    rotary_embedding_cpu_(qk, positions, cos, sin)

    torch.testing.assert_close(qkv[:, :12], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 12:], value)  # the value heads are untouched


def test_rotary_embedding_rejects_a_position_outside_the_tables():
    cos, sin = _tables(16, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        rotary_embedding_cpu_(_randn(2, 1, 8), torch.tensor([0, 16]), cos, sin)


def test_rows_are_batch_invariant_bit_for_bit():
    """Each op's row is identical alone and inside any batch, with one thread or two."""
    torch.set_num_threads(2)
    x, delta, weight = _randn(40, 576), _randn(40, 576, seed=1), _randn(576, seed=2)
    gate_up = _randn(40, 2 * 1536, seed=3)
    cos, sin = _tables(64, 64)
    heads, positions = _randn(40, 12, 64, seed=4), torch.arange(40) % 64

    batched = (rms_norm_cpu(x, weight, 1e-5), *add_rms_norm_cpu(x, delta, weight, 1e-5), silu_and_mul_cpu(gate_up))
    rotated = heads.clone()
    rotary_embedding_cpu_(rotated, positions, cos, sin)
    for i in (0, 17, 39):
        alone = (
            rms_norm_cpu(x[i : i + 1], weight, 1e-5),
            *add_rms_norm_cpu(x[i : i + 1], delta[i : i + 1], weight, 1e-5),
            silu_and_mul_cpu(gate_up[i : i + 1]),
        )
        for whole, row in zip(batched, alone):
            assert torch.equal(whole[i : i + 1], row)
        one = heads[i : i + 1].clone()
        rotary_embedding_cpu_(one, positions[i : i + 1], cos, sin)
        assert torch.equal(rotated[i : i + 1], one)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("width", [8, 37, 384, 1000])
def test_add_layer_norm_matches_torch(width, with_bias):
    x, delta = _randn(29, width, scale=3.0), _randn(29, width, seed=1)
    weight, beta, bias = _randn(width, seed=2), _randn(width, seed=3), _randn(width, seed=4)

    out = add_layer_norm_cpu(x, delta, bias if with_bias else None, weight, beta, 1e-12)

    total = x + delta + bias if with_bias else x + delta
    torch.testing.assert_close(out, F.layer_norm(total, (width,), weight, beta, 1e-12), atol=1e-5, rtol=1e-5)


def test_add_layer_norm_reads_strided_rows_and_is_row_wise():
    wide, delta = _randn(20, 400, scale=5.0), _randn(20, 384, seed=1)
    x = wide[:, 8:392]
    weight, beta = _randn(384, seed=2), _randn(384, seed=3)

    out = add_layer_norm_cpu(x, delta, None, weight, beta, 1e-5)

    assert torch.equal(out[7:9], add_layer_norm_cpu(x[7:9], delta[7:9], None, weight, beta, 1e-5))
    torch.testing.assert_close(out, F.layer_norm(x + delta, (384,), weight, beta, 1e-5), atol=1e-5, rtol=1e-5)


def test_bias_gelu_is_the_exact_erf_gelu_in_place():
    x, bias = _randn(33, 1536, scale=4.0), _randn(1536, seed=1)
    expected = F.gelu(x + bias)  # approximate="none": the erf form
    tanh_form = F.gelu(x + bias, approximate="tanh")

    bias_gelu_cpu_(x, bias)

    torch.testing.assert_close(x, expected, atol=2e-6, rtol=1e-5)
    assert (x - tanh_form).abs().max() > 1e-5  # the check above can tell the two forms apart


def test_bias_gelu_refuses_a_width_not_a_multiple_of_8():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        bias_gelu_cpu_(_randn(2, 12), _randn(12))


@pytest.mark.parametrize(
    ("num_rows", "hidden", "intermediate", "num_heads", "head_size"),
    [(7, 40, 32, 2, 16), (37, 576, 1536, 9, 64)],  # odd widths; SmolLM2's shapes (every vector path)
)
def test_bfloat16_inputs_are_widened_computed_once_and_rounded_once(
    num_rows: int, hidden: int, intermediate: int, num_heads: int, head_size: int
):
    """bf16 through the decoder ops: the float32 kernel on the widened values, each result rounded to bf16 once
    (shapes, dtypes and the in-place rotation of a strided view kept)."""
    gen = torch.Generator().manual_seed(5)
    x, delta = (torch.randn(num_rows, hidden, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(hidden, generator=gen).bfloat16()
    gate_up = (4 * torch.randn(num_rows, 2 * intermediate, generator=gen)).bfloat16()
    fused = torch.randn(num_rows, 3, num_heads, head_size, generator=gen).bfloat16()
    q = fused[:, 0]  # strided like the q heads of a fused qkv projection
    cos = torch.randn(30, head_size, generator=gen).bfloat16()
    sin = torch.randn(30, head_size, generator=gen).bfloat16()
    positions = torch.randint(0, 30, (num_rows,), generator=gen)
    expected_q = q.float().clone()
    rotary_embedding_cpu_(expected_q, positions, cos.float(), sin.float())

    normed = rms_norm_cpu(x, weight, 1e-6)
    total, total_normed = add_rms_norm_cpu(x, delta, weight, 1e-6)
    activated = silu_and_mul_cpu(gate_up)
    rotary_embedding_cpu_(q, positions, cos, sin)

    assert all(t.dtype == torch.bfloat16 for t in (normed, total, total_normed, activated))
    assert torch.equal(normed, rms_norm_cpu(x.float(), weight.float(), 1e-6).bfloat16())
    expected_total, expected_normed = add_rms_norm_cpu(x.float(), delta.float(), weight.float(), 1e-6)
    assert torch.equal(total, expected_total.bfloat16()) and torch.equal(total_normed, expected_normed.bfloat16())
    assert torch.equal(activated, silu_and_mul_cpu(gate_up.float()).bfloat16())
    assert torch.equal(fused[:, 0], expected_q.bfloat16())

"""The GGUF block linear layer (kernels/cpu_q4.cpp) against a plain torch dequantize-matmul (kernels/reference.py).

One case per instruction-set path (AVX-512 VNNI, AVX2; each forced by name, so a machine with AVX-512 checks
both), activation path (float32, int8) and block type; blocks come from the ``gguf`` package's own quantizers,
so the layout is ggml's. A path this CPU does not run is skipped, saying so.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu_q4 import GGUF_BLOCK_TYPES, gguf_kernel_isa, gguf_kernel_isas, linear_gguf
from kernels.reference import (
    dequantize_gguf_blocks,
    linear_gguf_reference,
    quantize_activations_q8,
    quantize_q4_1,
    quantize_q8_0,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(float weight, its blocks quantized by gguf's reference quantizer)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[type_name])
    return weight, torch.from_numpy(np.ascontiguousarray(blocks))


@pytest.mark.parametrize("type_name", list(GGUF_BLOCK_TYPES))
def test_dequantize_matches_gguf(type_name):
    _, blocks = _blocks(type_name, 7, 96)
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantize_gguf_blocks(blocks, GGUF_BLOCK_TYPES[type_name]), torch.from_numpy(want))


def test_quantize_q4_1_matches_gguf():
    weight, blocks = _blocks("Q4_1", 9, 64)
    ours = quantize_q4_1(weight)
    # Scales are float16 rounded from the same float32 values; a quant may differ by one where x sits on a
    # rounding boundary, so compare dequantized weights within one step.
    step = dequantize_gguf_blocks(ours, 3).sub(dequantize_gguf_blocks(blocks, 3)).abs()
    assert ours.shape == blocks.shape and step.max() <= (weight.amax() - weight.amin()) / 15


def test_quantize_q8_0_matches_gguf():
    weight, blocks = _blocks("Q8_0", 9, 64)
    assert torch.equal(dequantize_gguf_blocks(quantize_q8_0(weight), 8), dequantize_gguf_blocks(blocks, 8))


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["f32-activations", "q8-activations"])
@pytest.mark.parametrize("type_name", list(GGUF_BLOCK_TYPES))
@pytest.mark.parametrize("num_rows", [1, 3, 4, 9, 70])
@pytest.mark.parametrize("isa", ["avx512vnni", "avx2"])
def test_each_isa_matches_dequantize_matmul(isa, type_name, quantize_activations, num_rows):
    # in_features 160 is 5 blocks: the AVX-512 path's pairs of blocks and its odd last block.
    out_features, in_features = 37, 160
    _, blocks = _blocks(type_name, out_features, in_features)
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(num_rows, in_features, generator=gen), torch.randn(out_features, generator=gen)
    block_type = GGUF_BLOCK_TYPES[type_name]
    if not gguf_kernel_isas():  # a CPU without AVX2/FMA/F16C: the kernel refuses, naming them
        with pytest.raises(RuntimeError, match="AVX2, FMA and F16C"):
            linear_gguf(x, blocks, block_type, out_features, bias, quantize_activations, isa)
        return
    if isa not in gguf_kernel_isas():
        pytest.skip(f"this CPU (or build) does not run the {isa} path")
    got = linear_gguf(x, blocks, block_type, out_features, bias, quantize_activations, isa)
    want = linear_gguf_reference(x, blocks, block_type, bias, quantize_activations)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if not quantize_activations:
        # Weight-only: the plain torch dequantize-matmul is the reference itself.
        plain = torch.nn.functional.linear(x, dequantize_gguf_blocks(blocks, block_type), bias)
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 4, 7, 18])
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("isa", ["avx512vnni", "avx2"])
def test_q4_1_float_activations_every_group_tail(isa, num_rows, num_blocks):
    # The AVX-512 Q4_1 path takes blocks four at a time (one register of nibbles); a last group of 1-3 blocks is
    # loaded masked, strided activation rows (a view) are read in place, and 19 weight rows leave one unpaired.
    if isa not in gguf_kernel_isas():
        pytest.skip(f"this CPU (or build) does not run the {isa} path")
    out_features, in_features = 19, 32 * num_blocks
    _, blocks = _blocks("Q4_1", out_features, in_features, seed=num_blocks)
    x = torch.randn(num_rows, in_features + 8, generator=torch.Generator().manual_seed(2))[:, 3 : 3 + in_features]
    got = linear_gguf(x, blocks, 3, out_features, isa=isa)
    plain = torch.nn.functional.linear(x, dequantize_gguf_blocks(blocks, 3))
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-4)
    if isa == "avx512vnni":
        # Batch invariance: a row alone (weight rows in pairs) sums in the same order as within a group of rows.
        assert torch.equal(linear_gguf(x[:1], blocks, 3, out_features, isa=isa), got[:1])


def test_default_isa_is_the_best_and_an_unknown_one_is_refused_by_name():
    _, blocks = _blocks("Q4_1", 4, 64)
    x = torch.randn(2, 64)
    if not gguf_kernel_isas():
        pytest.skip("no GGUF kernel path on this CPU")
    assert gguf_kernel_isa() == gguf_kernel_isas()[0] and gguf_kernel_isas()[-1] == "avx2"
    assert torch.equal(linear_gguf(x, blocks, 3, 4), linear_gguf(x, blocks, 3, 4, isa=gguf_kernel_isa()))
    with pytest.raises(RuntimeError, match="instruction set 'sse2' is not available"):
        linear_gguf(x, blocks, 3, 4, isa="sse2")


def test_activation_quantizer_rounds_half_to_even_and_keeps_zero_blocks():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    q, d, s = quantize_activations_q8(x)
    assert q.abs().max() == 127 and d[0, 1] == 0 and s[0, 1] == 0 and q[0, 32:].eq(0).all()
    torch.testing.assert_close(s[0, 0], d[0, 0] * q[0, :32].sum())


def test_bad_inputs_are_refused():
    _, blocks = _blocks("Q4_1", 4, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="block type 6 is not served"):
        linear_gguf(x, blocks, 6, 4)
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        linear_gguf(torch.randn(2, 48), blocks, 3, 4)
    with pytest.raises(RuntimeError, match="blocks must be"):
        linear_gguf(x, blocks[:, :20].contiguous(), 3, 4)

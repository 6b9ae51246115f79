"""oneDNN's prepacked float32 linear (BERT's GEMMs) against ``F.linear`` and exact GELU; bfloat16 against the
float32-accumulator twin, and the bfloat16 PackedLinear's routing of tall calls to oneDNN on AMX-BF16 CPUs."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kernels.reference import linear_bf16_reference
from worker.engine.executor.layers.onednn_linear import (
    amx_bf16_available,
    onednn_linear_available,
    pack_linear_weight,
    packed_linear,
    padded_rows,
)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("gelu", [False, True])
def test_packed_linear_matches_f_linear(rows, gelu):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(160, 96, generator=generator) / 10
    bias = torch.randn(160, generator=generator)
    expected = F.linear(x, weight, bias)
    if gelu:
        expected = F.gelu(expected)  # the exact erf form, BERT's "gelu"
    out = packed_linear(x, pack_linear_weight(weight, 64), bias, gelu=gelu)
    assert out.shape == (rows, 160) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_packed_linear_without_bias():
    x, weight = torch.randn(5, 32), torch.randn(48, 32)
    torch.testing.assert_close(packed_linear(x, pack_linear_weight(weight, 8), None), F.linear(x, weight))


def test_padded_rows_rounds_up_to_the_multiple():
    assert [padded_rows(n) for n in (1, 63, 64, 65, 4096)] == [64, 64, 64, 128, 4096]
    assert [padded_rows(n, 16) for n in (1, 8, 16, 17)] == [16, 16, 16, 32]


def _bf16_linear(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) / 10)
        linear.bias.copy_(torch.randn(out_features, generator=generator))
    return linear


@pytest.mark.parametrize("rows", [1, 16, 100])
def test_bfloat16_packed_linear_rounds_the_float32_sum_once(rows):
    """Within one bfloat16 unit of the exact float32 sum rounded to bfloat16 (as the C++ bf16 kernel's test)."""
    linear = _bf16_linear(96, 160)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = packed_linear(x, pack_linear_weight(linear.weight, 64), linear.bias)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    expected = linear_bf16_reference(x, linear.weight, linear.bias)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-3, rtol=2**-7)


def test_bfloat16_packed_linear_routes_tall_calls_to_onednn(monkeypatch):
    """On AMX-BF16, calls of ONEDNN_MIN_ROWS rows or more run on oneDNN (rows padded, result sliced), shorter ones
    on the C++ kernel bit for bit; BATCHINFER_BF16_ONEDNN=0 keeps the C++ kernel (batch invariant) everywhere."""
    from kernels.cpu_extension import DISABLE_ENV, cpu_kernels_available
    from kernels.cpu_gemm import linear_bf16_supported, linear_packed_bf16
    from worker.engine.executor.layers import linear as linear_module

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(linear_module.ONEDNN_BF16_ENV, raising=False)
    if not cpu_kernels_available():
        pytest.skip("the C++ kernels cannot be built here")
    if not (linear_bf16_supported() and amx_bf16_available()):
        pytest.skip("the CPU has no AVX512_BF16 or no AMX-BF16")
    original = _bf16_linear(96, 160)
    model = nn.Sequential(original)
    linear_module.pack_linear_layers(model)
    layer = model[0]
    assert isinstance(layer, linear_module.PackedLinear) and layer.onednn_weight is not None
    x = torch.randn(2, 11, 160, generator=torch.Generator().manual_seed(3)).bfloat16()  # 22 rows: padded to 32
    short_rows = x[0, : linear_module.ONEDNN_MIN_ROWS - 1]

    tall, short = layer(x), layer(short_rows)

    assert tall.shape == (2, 11, 96)
    expected = linear_bf16_reference(x, original.weight, original.bias)
    torch.testing.assert_close(tall.float(), expected.float(), atol=1e-3, rtol=2**-7)
    assert torch.equal(short, linear_packed_bf16(short_rows, layer.packed_weight, 96, layer.bias))

    monkeypatch.setenv(linear_module.ONEDNN_BF16_ENV, "0")
    plain = nn.Sequential(_bf16_linear(96, 160))
    linear_module.pack_linear_layers(plain)
    assert plain[0].onednn_weight is None
    assert torch.equal(plain[0](x), linear_packed_bf16(x, plain[0].packed_weight, 96, plain[0].bias))


def test_bfloat16_packed_linear_keeps_the_packed_kernel_in_a_batch_invariant_step(monkeypatch):
    """In a step that must be batch invariant (forward_context) a layer holding oneDNN's copy runs its tall calls on
    the C++ kernel (the bits of each row alone); outside one they go to oneDNN (here a stand-in that records them,
    so the routing is checked on any CPU)."""
    from kernels.cpu_extension import cpu_kernels_available
    from kernels.cpu_gemm import linear_bf16_supported, linear_packed_bf16
    from worker.engine.executor.forward_context import batch_invariant_step
    from worker.engine.executor.layers import linear as linear_module

    if not (cpu_kernels_available() and linear_bf16_supported()):
        pytest.skip("the C++ bfloat16 kernel cannot run here")
    layer = linear_module.PackedLinear(_bf16_linear(96, 160), onednn=True)
    onednn_rows = []

    def onednn_stand_in(rows, weight, bias):
        onednn_rows.append(rows.shape[0])
        return rows.new_zeros(rows.shape[0], 96)

    monkeypatch.setattr(linear_module.onednn_linear, "packed_linear", onednn_stand_in)
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(4)).bfloat16()

    with batch_invariant_step(True):
        invariant = layer(x)
    assert onednn_rows == []
    assert torch.equal(invariant, linear_packed_bf16(x, layer.packed_weight, 96, layer.bias))
    assert torch.equal(invariant[5], linear_packed_bf16(x[5:6], layer.packed_weight, 96, layer.bias)[0])
    with batch_invariant_step(False):
        layer(x)
    layer(x)  # outside any step
    assert onednn_rows == [48, 48]  # padded to a multiple of 16


def test_bfloat16_routing_follows_the_cpu_flags(monkeypatch):
    """The oneDNN route is chosen from the CPU's flags at load: without ``amx_bf16`` a bfloat16 layer keeps the C++
    kernel alone (one weight copy, batch invariant), with it the layer also holds oneDNN's copy."""
    from kernels.cpu_extension import DISABLE_ENV, cpu_kernels_available
    from kernels.cpu_gemm import linear_bf16_supported
    from worker.engine.executor.layers import linear as linear_module
    from worker.engine.executor.layers import onednn_linear as onednn_module

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(linear_module.ONEDNN_BF16_ENV, raising=False)
    if not (cpu_kernels_available() and linear_bf16_supported()):
        pytest.skip("the C++ bfloat16 kernel cannot run here")
    for flags, routed in ((frozenset({"avx512_bf16"}), False), (frozenset({"avx512_bf16", "amx_bf16"}), True)):
        monkeypatch.setattr(onednn_module, "cpu_flags", lambda flags=flags: flags)
        model = nn.Sequential(_bf16_linear(96, 160))
        linear_module.pack_linear_layers(model)
        assert linear_module.onednn_bf16_applies() is routed
        assert (model[0].onednn_weight is not None) is routed


@pytest.mark.skipif(not amx_bf16_available(), reason="the CPU has no AMX-BF16")
def test_bfloat16_onednn_runs_on_amx_tiles():
    """On an AMX-BF16 CPU oneDNN's verbose log names an AMX implementation for the prepacked bfloat16 linear (the
    reason for the route; a oneDNN that fell back to AVX-512 would be 4-14x slower from 16 rows up)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import torch\n"
        "from worker.engine.executor.layers.onednn_linear import pack_linear_weight, packed_linear\n"
        "w = torch.randn(96, 160).bfloat16()\n"
        "packed_linear(torch.randn(64, 160).bfloat16(), pack_linear_weight(w, 64), None)\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    repo = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, cwd=repo)
    lines = done.stdout.splitlines()
    matmuls = [line for line in lines if ",exec," in line and ("matmul" in line or "inner_product" in line)]
    assert matmuls and all("amx" in line for line in matmuls), done.stdout[-2000:]


def test_a_model_off_the_cpu_never_builds_the_cpu_kernels(monkeypatch):
    """pack_linear_layers on a model with no CPU parameter (a CUDA worker's; here the meta device) replaces nothing
    and never asks for the C++ library, whose first use compiles it."""
    from worker.engine.executor.layers import linear as linear_module

    def build():
        raise AssertionError("the C++ kernels were asked for")

    monkeypatch.setattr(linear_module, "cpu_kernels_available", build)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))

    assert linear_module.pack_linear_layers(model) == 0
    assert all(isinstance(layer, nn.Linear) for layer in model)

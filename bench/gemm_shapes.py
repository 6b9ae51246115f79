"""CPU time of one linear layer per GEMM implementation, at SmolLM2-135M's shapes and the heights the engine runs.

For each projection of SmolLM2-135M (``qkv`` 576 -> 960, ``o`` 576 -> 576, ``gate_up`` 576 -> 3072, ``down``
1536 -> 576, ``lm_head`` 576 -> 49152) and each height ``M`` (rows: 1, 8, 32, 64 for decode batches, 512 and 2048
for prefill chunks; the LM head only at decode heights, since the engine computes logits for sampled rows only)
it times, on one thread (``torch.set_num_threads(1)``), every implementation below that this machine runs:

- ``fp32``: ``ours`` (:func:`kernels.cpu_gemm.linear_packed`), ``torch`` (``F.linear``, MKL's sgemm);
- ``bf16``: ``ours`` (:func:`kernels.cpu_gemm.linear_packed_bf16`, ``vdpbf16ps``), ``onednn64`` (oneDNN's prepacked
  linear, weight laid out for 64 rows, as :mod:`worker.engine.executor.layers.onednn_linear` packs it),
  ``onednnM`` (the same, laid out for this height), ``torch`` (``F.linear`` in bfloat16, oneDNN without prepacking),
  ``engine`` (:class:`worker.engine.executor.layers.linear.PackedLinear` as the loader builds it here, with its
  routing by height and row padding);
- ``int8``: ``ours`` (:func:`kernels.cpu_q4.linear_gguf` on Q8_0 blocks, float32 activations: the engine's int8),
  ``ours_q8act`` (the same with int8 activations per block of 32), ``int8pack`` (``torch._weight_int8pack_mm``,
  bfloat16 activations, per-channel int8 weight), ``onednn_w8a8`` (``torch.ops.onednn.qlinear_pointwise``: int8
  activations quantized per row in the timed call, per-channel int8 weight, the row scales applied after), and
  ``ao_dynamic`` (``torch.ops.quantized.linear_dynamic`` under the ``x86`` quantized engine, per-tensor activation
  scale);
- ``q4``: ``ours`` (:func:`kernels.cpu_q4.linear_gguf` on Q4_1 blocks, float32 activations: the engine's q4),
  ``int4pack`` (``torch._weight_int4pack_mm_for_cpu``, bfloat16 activations, groups of 32).

Method: random weights (normal, std 0.05) and activations, packed once per shape; each implementation is called
twice untimed (oneDNN builds its primitive on first use), then ``--repeats`` timed batches of ``k`` calls (``k``
chosen so a batch takes about 2 ms of CPU), the figure is the median batch's ``time.process_time`` divided by
``k``: CPU time, meaningful on a shared machine where wall time is not. The weights stay in cache between calls
(L2 or the large L3), as most of them do between an engine's steps here. Numerics differ between settings (each
row is its own quantization); this measures speed only.

Usage: python bench/gemm_shapes.py [--repeats 7] [--heights 1,8,32,64,512,2048] [--shapes qkv,o,gate_up,down,lm_head]
Prints one markdown table (ms of CPU per call, the fastest of each setting in bold) and a last line with one JSON
object ``{"shape": {"M": {"setting/impl": ms}}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.cpu_extension import cpu_flags, require_cpu_kernels
from kernels.cpu_gemm import (
    linear_bf16_supported,
    linear_packed,
    linear_packed_bf16,
    pack_linear_weight,
    pack_linear_weight_bf16,
)
from kernels.cpu_q4 import GGUF_BLOCK_TYPES, linear_gguf
from kernels.reference import quantize_q4_1, quantize_q8_0
from worker.engine.executor.layers import onednn_linear
from worker.engine.executor.layers.linear import PackedLinear, onednn_bf16_applies

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DECODE_ONLY = ("lm_head",)
PREFILL_MIN_ROWS = 512  # heights from here up are prefill chunks
BATCH_CPU_S = 0.002  # CPU time a timed batch of calls aims at

Call = Callable[[], object]


def cpu_ms(call: Call, repeats: int) -> float:
    """Median CPU milliseconds of one ``call`` (see the module docstring)."""
    call()
    call()
    start = time.process_time()
    call()
    once = max(time.process_time() - start, 1e-6)
    per_batch = max(1, int(BATCH_CPU_S / once))
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(per_batch):
            call()
        samples.append((time.process_time() - start) / per_batch)
    return statistics.median(samples) * 1e3


def fp32_calls(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Call]:
    packed = pack_linear_weight(weight)
    n = weight.shape[0]
    return {"ours": lambda: linear_packed(x, packed, n), "torch": lambda: F.linear(x, weight)}


def bf16_calls(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Call]:
    w16, x16 = weight.bfloat16(), x.bfloat16()
    calls: dict[str, Call] = {"torch": lambda: F.linear(x16, w16)}
    if linear_bf16_supported():
        packed = pack_linear_weight_bf16(w16)
        n = weight.shape[0]
        calls["ours"] = lambda: linear_packed_bf16(x16, packed, n)
        layer = nn.Linear(weight.shape[1], n, bias=False, dtype=torch.bfloat16)
        layer.weight.data.copy_(w16)
        engine = PackedLinear(layer, onednn=onednn_bf16_applies())
        calls["engine"] = lambda: engine(x16)
    if onednn_linear.onednn_linear_available():
        for name, hint in (("onednn64", 64), ("onednnM", x.shape[0])):
            prepacked = onednn_linear.pack_linear_weight(w16, hint)
            calls[name] = lambda prepacked=prepacked: onednn_linear.packed_linear(x16, prepacked, None)
    return calls


def int8_calls(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Call]:
    n = weight.shape[0]
    blocks = quantize_q8_0(weight)
    q8 = GGUF_BLOCK_TYPES["Q8_0"]
    scales = weight.abs().amax(1) / 127
    wq = torch.round(weight / scales[:, None]).to(torch.int8)
    x16, s16 = x.bfloat16(), scales.bfloat16()
    calls: dict[str, Call] = {
        "ours": lambda: linear_gguf(x, blocks, q8, n),
        "ours_q8act": lambda: linear_gguf(x, blocks, q8, n, None, True),
        "int8pack": lambda: torch._weight_int8pack_mm(x16, wq, s16),
    }
    if hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise"):
        prepacked = torch.ops.onednn.qlinear_prepack(wq, list(x.shape))
        zeros = torch.zeros(n, dtype=torch.long)

        def w8a8() -> torch.Tensor:
            row_scales = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            xq = torch.round(x / row_scales).to(torch.int8)
            out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 0, prepacked, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return out.mul_(row_scales)

        calls["onednn_w8a8"] = w8a8
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
        qweight = torch.quantize_per_channel(weight, scales, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        dynamic = torch.ops.quantized.linear_prepack(qweight, None)
        calls["ao_dynamic"] = lambda: torch.ops.quantized.linear_dynamic(x, dynamic, True)
    return calls


def q4_calls(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Call]:
    n, k = weight.shape
    blocks = quantize_q4_1(weight)
    q41 = GGUF_BLOCK_TYPES["Q4_1"]
    groups = weight.reshape(n, k // 32, 32)
    low, high = groups.amin(2), groups.amax(2)
    step = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    int4 = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    # int4pack dequantizes (q - 8) * scale + zero: the zero is the group's midpoint.
    scale_zeros = torch.stack([step.T, (low + 8 * step).T], -1).bfloat16().contiguous()
    x16 = x.bfloat16()
    return {
        "ours": lambda: linear_gguf(x, blocks, q41, n),
        "int4pack": lambda: torch._weight_int4pack_mm_for_cpu(x16, int4, 32, scale_zeros),
    }


SETTINGS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, Call]]] = {
    "fp32": fp32_calls,
    "bf16": bf16_calls,
    "int8": int8_calls,
    "q4": q4_calls,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heights", default="1,8,32,64,512,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    require_cpu_kernels()
    heights = [int(h) for h in args.heights.split(",")]
    amx = sorted(flag for flag in cpu_flags() if flag.startswith("amx"))
    print(f"torch {torch.__version__}, 1 thread, CPU flags {amx or 'no AMX'}, median of {args.repeats}")
    results: dict[str, dict[int, dict[str, float]]] = {}
    print("| shape (N x K) | M | " + " | ".join(SETTINGS) + " |")
    print("|---|---|" + "---|" * len(SETTINGS))
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        weight = torch.randn(n, k) * 0.05
        for m in heights:
            if shape in DECODE_ONLY and m >= PREFILL_MIN_ROWS:
                continue
            x = torch.randn(m, k)
            row = results.setdefault(shape, {}).setdefault(m, {})
            cells = []
            for setting, make in SETTINGS.items():
                timed = {impl: cpu_ms(call, args.repeats) for impl, call in make(weight, x).items()}
                row.update({f"{setting}/{impl}": ms for impl, ms in timed.items()})
                best = min(timed, key=timed.__getitem__)
                cells.append(
                    " / ".join(
                        f"**{impl} {ms:.3g}**" if impl == best else f"{impl} {ms:.3g}" for impl, ms in timed.items()
                    )
                )
            print(f"| {shape} ({n} x {k}) | {m} | " + " | ".join(cells) + " |", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

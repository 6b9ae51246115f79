"""C++ linear layer over a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0) for CPUs with AVX2 or AVX-512 VNNI
(issue #27).

The source is ``cpu_q4.cpp`` next to this file, built with the other CPU kernels by :mod:`kernels.cpu_extension`
(check :func:`kernels.cpu_extension.cpu_kernels_available` first). The weight is ggml's block layout as the
file holds it (one ``uint8`` row of ``in_features / 32`` blocks per output feature); the method is llama.cpp's
(``ggml-cpu``'s dot products): dequantization in registers against float32 activations, or activations
quantized per block to int8 and an integer dot (``vpdpbusd`` on AVX-512 VNNI, ``vpmaddubsw`` on AVX2). The
instruction set is chosen per call at run time, the best this CPU runs unless one is named
(:func:`gguf_kernel_isas`). The twin is :func:`kernels.reference.linear_gguf_reference`.

This module imports nothing of batchinfer's outside ``kernels``.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import require_cpu_kernels

GGUF_BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml type name -> ggml type id
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # ggml type id -> bytes per block of 32 weights
GGUF_BLOCK_SIZE = 32


def gguf_kernel_isas() -> list[str]:
    """The instruction-set paths of the GGUF block kernels this build and CPU run, best first:
    ``"avx512vnni"`` (AVX-512 F/BW/VL/VNNI), ``"avx2"`` (AVX2 + FMA + F16C); empty where the CPU lacks AVX2
    (the kernels then refuse every call).

    Raises:
        RuntimeError: when the kernels are unavailable.
    """
    require_cpu_kernels()
    isas: list[str] = torch.ops.batchinfer_cpu.gguf_linear_isas()
    return isas


def gguf_kernel_isa() -> str:
    """The path :func:`linear_gguf` takes by default here (the first of :func:`gguf_kernel_isas`), or ``""``.

    Raises:
        RuntimeError: when the kernels are unavailable.
    """
    isas = gguf_kernel_isas()
    return isas[0] if isas else ""


def linear_gguf(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = False,
    isa: str = "",
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` held as GGUF blocks, dequantized in registers.

    With ``quantize_activations=False`` each output is a float32 FMA sum of ``x`` times the dequantized weight
    (only the summation order differs from a dequantize-matmul). With ``True`` each row of ``x`` is first
    quantized per block of 32 to int8 (scale ``max|x| / 127``, round half to even, llama.cpp's Q8_1) and each
    block's dot is an integer dot scaled by both scales: faster, with the activations' rounding added.

    Args:
        x: float32 CPU ``[..., in_features]`` with unit stride in the last dimension; ``in_features`` a
            multiple of 32.
        blocks: uint8 contiguous ``[out_features, in_features / 32 * GGUF_BLOCK_BYTES[block_type]]``.
        block_type: ggml type id, one of :data:`GGUF_BLOCK_TYPES`' values.
        out_features: rows of the weight.
        bias: optional float32 ``[out_features]``.
        quantize_activations: the int8-activation path (see above).
        isa: ``""`` (the best of :func:`gguf_kernel_isas`) or one of them by name (tests check each path).

    Returns:
        float32 contiguous ``[..., out_features]``.

    Raises:
        RuntimeError: when the kernels are unavailable, the CPU lacks AVX2/FMA/F16C (named), ``isa`` names a
            path this CPU does not run (named), a block type is not served, or on mismatched shapes or dtypes.
    """
    require_cpu_kernels()
    # NOTE: 2-D input (the layers' case) goes as it is: reshape and view cost about 2 us of a batch-1 call's 8
    # (121 a step).
    flat = x.dim() == 2
    out: torch.Tensor = torch.ops.batchinfer_cpu.gguf_linear(
        x if flat else x.reshape(-1, x.shape[-1]), blocks, block_type, out_features, bias, quantize_activations, isa
    )
    return out if flat else out.view(*x.shape[:-1], out_features)


GGUF_BF16_BLOCK_TYPES = (2, 3)  # ggml type ids with a bfloat16-activation kernel: Q4_0, Q4_1


def gguf_bf16_supported() -> bool:
    """Whether this build has the bfloat16-activation Q4 kernel (``cpu_q4_bf16.cpp``: the CPU has AVX512_BF16).

    Raises:
        RuntimeError: when the kernels are unavailable.
    """
    require_cpu_kernels()
    supported: bool = torch.ops.batchinfer_cpu.gguf_linear_bf16_supported()
    return supported


def gguf_pack_bf16(blocks: torch.Tensor, block_type: int, in_features: int) -> torch.Tensor:
    """Regroup Q4_0 / Q4_1 blocks for :func:`linear_gguf_bf16`: panels of 32 output columns, per block of 32 inputs
    the nibbles of each pair of inputs side by side (the operand layout of ``vdpbf16ps``), then the columns' float16
    ``d`` (and ``m`` for Q4_1). Same bits a weight as the file (4.5 for Q4_0, 5 for Q4_1); layout in
    ``cpu_q4_bf16.cpp``.

    Args:
        blocks: uint8 ``[out_features, in_features / 32 * GGUF_BLOCK_BYTES[block_type]]`` in ggml's layout.
        block_type: 2 (Q4_0) or 3 (Q4_1).
        in_features: a positive multiple of 32.

    Returns:
        uint8 contiguous ``[ceil(out_features / 32), in_features / 32, 576 (Q4_0) or 640 (Q4_1)]``.

    Raises:
        RuntimeError: without AVX512_BF16 (named), on another block type, or on mismatched shapes.
    """
    require_cpu_kernels()
    packed: torch.Tensor = torch.ops.batchinfer_cpu.gguf_pack_bf16(blocks, block_type, in_features)
    return packed


def linear_gguf_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_type: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 with ``W`` Q4_0 / Q4_1 blocks packed by :func:`gguf_pack_bf16`.

    Two numerics (source ``cpu_q4_bf16.cpp``). A call of up to 24 rows (decode; the kernel's ``kDirectRows``), or
    of any height with ``batch_invariant``, sums in float32: the bias, for Q4_1 the blocks' ``m`` times the sums of their 32
    activations, then block by block ``d`` times the block's dot of the activations with the integer quants
    (``vdpbf16ps``: the weights enter exactly, only the activations are bfloat16), the same chain at every height,
    so a row's bits are those of the row alone. A taller call without ``batch_invariant`` (faster) dequantizes each
    weight to bfloat16 (``d (q - 8)`` or ``d q + m`` in float32, rounded once to nearest even) and runs the packed
    bfloat16 GEMM's chain over them (:func:`kernels.cpu_gemm.linear_packed_bf16`: the same bits as that kernel over
    those weights), whose results differ from the exact chain's by the weights' bfloat16 rounding: without
    ``batch_invariant`` a row's output depends on whether its call has more than 24 rows. Rounded to bfloat16
    once. Reference:
    :func:`kernels.reference.linear_gguf_bf16_reference`.

    Args:
        x: bfloat16 CPU ``[..., in_features]`` with unit stride in the last dimension.
        packed: from :func:`gguf_pack_bf16` with the same ``block_type``.
        block_type: 2 (Q4_0) or 3 (Q4_1).
        out_features: rows of the weight.
        bias: optional ``[out_features]`` (any float dtype; added in float32).
        batch_invariant: the exact-weight chain at every height (the engine sets it for steps that hold a seeded
            sequence, :mod:`worker.engine.executor.forward_context`).

    Returns:
        bfloat16 contiguous ``[..., out_features]``.

    Raises:
        RuntimeError: without AVX512_BF16 (named), on another block type, or on mismatched shapes or dtypes.
    """
    require_cpu_kernels()
    flat = x.dim() == 2
    out: torch.Tensor = torch.ops.batchinfer_cpu.gguf_linear_bf16(
        x if flat else x.reshape(-1, x.shape[-1]), packed, block_type, out_features, bias, batch_invariant
    )
    return out if flat else out.view(*x.shape[:-1], out_features)

"""Packed-weight linear layers for float32 and bfloat16 models on CPU (:mod:`kernels.cpu_gemm`).

MKL's sgemm streams a decoder's weights at a fraction of memory bandwidth when the activation has
few rows (one per running sequence during decode); the packed kernel reads each weight once per call
at close to bandwidth and stays ahead of MKL up to a few hundred rows. :func:`pack_linear_layers`
swaps every ``nn.Linear`` of a loaded model for :class:`PackedLinear` when the model is float32 on
CPU, or bfloat16 on a CPU with AVX512_BF16 (``vdpbf16ps``, float32 accumulation), and the C++ kernels are
available (``BATCHINFER_CPU_KERNELS=0`` keeps ``nn.Linear``; a bfloat16 model elsewhere keeps torch's).

On a CPU with AMX-BF16 a bfloat16 layer also holds its weight in oneDNN's layout and runs calls of
:data:`ONEDNN_MIN_ROWS` rows or more on oneDNN's AMX kernels (4-14x the packed kernel per thread from 16 rows up;
below 8 rows the packed kernel is as fast or faster, docs/engine.md "Packed-weight CPU GEMM"). oneDNN's result for a
row can depend on the number of rows, so a step that must be batch invariant (one holding a seeded sequence,
:func:`~worker.engine.executor.forward_context.step_is_batch_invariant`) keeps the packed kernel at every height;
``BATCHINFER_BF16_ONEDNN=0`` keeps it for every step (and one copy of each weight).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kernels.cpu_elementwise import PACKED_BF16_KIND
from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_gemm import (
    linear_bf16_supported,
    linear_packed,
    linear_packed_bf16,
    pack_linear_weight,
    pack_linear_weight_bf16,
)
from worker.engine.executor.forward_context import step_is_batch_invariant
from worker.engine.executor.layers import onednn_linear

ONEDNN_BF16_ENV = "BATCHINFER_BF16_ONEDNN"
ONEDNN_MIN_ROWS = 8  # bfloat16 calls of this many rows or more go to oneDNN where it applies
_ONEDNN_ROW_MULTIPLE = 16  # rows padded to a multiple of this: few oneDNN primitives to build, <= 15 wasted rows
_ONEDNN_BATCH_HINT = 64  # the height oneDNN's weight layout is chosen for


def onednn_bf16_applies() -> bool:
    """Whether bfloat16 :class:`PackedLinear` layers also run on oneDNN: the CPU has AMX-BF16, this torch has oneDNN's
    prepacked-linear ops, and ``BATCHINFER_BF16_ONEDNN`` is not ``0``."""
    return (
        os.environ.get(ONEDNN_BF16_ENV, "1") != "0"
        and onednn_linear.amx_bf16_available()
        and onednn_linear.onednn_linear_available()
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` inference twin holding its weight packed: ``[..., in_features] -> [..., out_features]``.

    Built from a float32 or bfloat16 CPU ``nn.Linear`` (its weight is copied into the packed layout of its
    dtype's kernel; the bias is shared), or over ``packed_weight`` packed before (a cached copy,
    :mod:`worker.engine.executor.prepared_weights`; ``linear`` then only gives the sizes and the bias, and
    may be on the meta device). Outputs match ``nn.Linear`` up to float32 rounding and are batch invariant
    (see :func:`kernels.cpu_gemm.linear_packed`), except for a bfloat16 layer built with ``onednn=True``: it
    also keeps the weight in oneDNN's layout (a second copy) and runs calls of :data:`ONEDNN_MIN_ROWS` rows or
    more there (:func:`onednn_linear.packed_linear`, rows padded to a multiple of 16), whose results may depend
    on the number of rows, unless the step must be batch invariant
    (:func:`~worker.engine.executor.forward_context.step_is_batch_invariant`: the packed kernel then).
    """

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor | None = None, *, onednn: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bf16 = linear.weight.dtype == torch.bfloat16
        if packed_weight is None:
            packed_weight = (pack_linear_weight_bf16 if bf16 else pack_linear_weight)(linear.weight.detach())
        self.packed_weight = nn.Buffer(packed_weight, persistent=False)
        self.bias = linear.bias
        # NOTE: an opaque oneDNN tensor, kept out of the module's buffers (state dicts and .to() cannot take it)
        self.onednn_weight: torch.Tensor | None = None
        if onednn and bf16:
            self.onednn_weight = onednn_linear.pack_linear_weight(linear.weight.detach(), _ONEDNN_BATCH_HINT)

    def cpu_kernel_weight(self) -> tuple[torch.Tensor, int] | None:
        """``(packed weight, kind)``, the arguments of the fused decoder-layer kernels
        (:func:`kernels.cpu_elementwise.decoder_attention_input_cpu`): kind 0 for a float32 layer,
        :data:`~kernels.cpu_elementwise.PACKED_BF16_KIND` for a bfloat16 one; ``None`` for a bfloat16 layer that
        also runs on oneDNN (its tall calls are not the packed kernel's)."""
        if self.packed_weight.dtype == torch.float32:
            return self.packed_weight, 0
        return (self.packed_weight, PACKED_BF16_KIND) if self.onednn_weight is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        if self.packed_weight.dtype != torch.bfloat16:
            return linear_packed(x, self.packed_weight, self.out_features, bias)
        rows = x.reshape(-1, self.in_features)
        if self.onednn_weight is None or rows.shape[0] < ONEDNN_MIN_ROWS or step_is_batch_invariant():
            return linear_packed_bf16(x, self.packed_weight, self.out_features, bias)
        num_rows = rows.shape[0]
        padding = onednn_linear.padded_rows(num_rows, _ONEDNN_ROW_MULTIPLE) - num_rows
        if padding:
            rows = torch.cat([rows, rows.new_zeros(padding, self.in_features)])
        out = onednn_linear.packed_linear(rows.contiguous(), self.onednn_weight, bias)
        return out[:num_rows].view(*x.shape[:-1], self.out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place; bfloat16 ones
    too where the CPU has AVX512_BF16, with oneDNN's copy for tall calls where :func:`onednn_bf16_applies`.

    Call after the weights are loaded. Does nothing when the C++ kernels are unavailable or disabled.
    A tied ``lm_head`` gets its own packed copy; the embedding keeps the original weight.

    Returns:
        The number of layers replaced.
    """
    # NOTE: a model on another device (CUDA) never builds the C++ kernels: checking the device first keeps a GPU
    # worker from compiling a CPU library it would not use.
    if not any(p.device.type == "cpu" for p in model.parameters()) or not cpu_kernels_available():
        return 0
    dtypes = (torch.float32, torch.bfloat16) if linear_bf16_supported() else (torch.float32,)
    onednn = torch.bfloat16 in dtypes and onednn_bf16_applies()
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                setattr(parent, name, PackedLinear(child, onednn=onednn))
                replaced += 1
    return replaced

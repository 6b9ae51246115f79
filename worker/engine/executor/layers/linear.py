"""Packed-weight linear layers for float32 and bfloat16 models on CPU (:mod:`kernels.cpu_gemm`).

MKL's sgemm streams a decoder's weights at a fraction of memory bandwidth when the activation has
few rows (one per running sequence during decode); the packed kernel reads each weight once per call
at close to bandwidth and stays ahead of MKL up to a few hundred rows. :func:`pack_linear_layers`
swaps every ``nn.Linear`` of a loaded model for :class:`PackedLinear` when the model is float32 on
CPU, or bfloat16 on a CPU with AVX512_BF16 (``vdpbf16ps``, float32 accumulation), and the C++ kernels are
available (``BATCHINFER_CPU_KERNELS=0`` keeps ``nn.Linear``; a bfloat16 model elsewhere keeps torch's).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_gemm import (
    linear_bf16_supported,
    linear_packed,
    linear_packed_bf16,
    pack_linear_weight,
    pack_linear_weight_bf16,
)


class PackedLinear(nn.Module):
    """``nn.Linear`` inference twin holding its weight packed: ``[..., in_features] -> [..., out_features]``.

    Built from a float32 or bfloat16 CPU ``nn.Linear`` (its weight is copied into the packed layout of its
    dtype's kernel; the bias is shared), or over ``packed_weight`` packed before (a cached copy,
    :mod:`worker.engine.executor.prepared_weights`; ``linear`` then only gives the sizes and the bias, and
    may be on the meta device). Outputs match ``nn.Linear`` up to float32 rounding and are batch invariant
    (see :func:`kernels.cpu_gemm.linear_packed`).
    """

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if packed_weight is None:
            bf16 = linear.weight.dtype == torch.bfloat16
            packed_weight = (pack_linear_weight_bf16 if bf16 else pack_linear_weight)(linear.weight.detach())
        self.packed_weight = nn.Buffer(packed_weight, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        if self.packed_weight.dtype == torch.bfloat16:
            return linear_packed_bf16(x, self.packed_weight, self.out_features, bias)
        return linear_packed(x, self.packed_weight, self.out_features, bias)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place; bfloat16 ones
    too where the CPU has AVX512_BF16.

    Call after the weights are loaded. Does nothing when the C++ kernels are unavailable or disabled.
    A tied ``lm_head`` gets its own packed copy; the embedding keeps the original weight.

    Returns:
        The number of layers replaced.
    """
    if not cpu_kernels_available():
        return 0
    dtypes = (torch.float32, torch.bfloat16) if linear_bf16_supported() else (torch.float32,)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced

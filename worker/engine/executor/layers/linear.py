"""Packed-weight linear layers for float32 models on CPU (:mod:`kernels.cpu_gemm`).

MKL's sgemm streams a decoder's weights at a fraction of memory bandwidth when the activation has
few rows (one per running sequence during decode); the packed kernel reads each weight once per call
at close to bandwidth and stays ahead of MKL up to a few hundred rows. :func:`pack_linear_layers`
swaps every ``nn.Linear`` of a loaded model for :class:`PackedLinear` when the model is float32 on
CPU and the C++ kernels are available (``BATCHINFER_CPU_KERNELS=0`` keeps ``nn.Linear``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_gemm import linear_packed, pack_linear_weight


class PackedLinear(nn.Module):
    """``nn.Linear`` inference twin holding its weight packed: ``[..., in_features] -> [..., out_features]``.

    Built from a float32 CPU ``nn.Linear`` (its weight is copied into the packed layout; the bias is
    shared), or over ``packed_weight`` packed before (a cached copy,
    :mod:`worker.engine.executor.prepared_weights`; ``linear`` then only gives the sizes and the bias, and
    may be on the meta device). Outputs match ``nn.Linear`` up to float32 rounding and are batch invariant
    (see :func:`kernels.cpu_gemm.linear_packed`).
    """

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if packed_weight is None:
            packed_weight = pack_linear_weight(linear.weight.detach())
        self.packed_weight = nn.Buffer(packed_weight, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return linear_packed(x, self.packed_weight, self.out_features, bias)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place.

    Call after the weights are loaded. Does nothing when the C++ kernels are unavailable or disabled.
    A tied ``lm_head`` gets its own packed copy; the embedding keeps the original weight.

    Returns:
        The number of layers replaced.
    """
    if not cpu_kernels_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.device.type == "cpu"
                and child.weight.dtype == torch.float32
            ):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced

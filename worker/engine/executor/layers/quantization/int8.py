"""Weight-only int8 linear layers for float32 models on CPU (:func:`kernels.cpu_gemm.linear_int8_packed`).

Decode reads every weight once per step, so at small batches its speed is bytes moved: int8 weights are a
quarter of float32's. Each ``nn.Linear`` weight of a decoder layer (q/k/v, o, gate/up, down) is quantized at
load, symmetric per output channel (:func:`kernels.reference.quantize_int8_per_channel`), and packed into the
float32 kernel's panel layout; activations stay float32 and each weight is converted to float in registers
(the issue's fallback for CPUs without VNNI or AMX-INT8, which is every CPU here). The embeddings, the norms
and the LM head stay float32 (the LM head reads the tied embedding in SmolLM2, and its logits decide the
token; docs/engine.md, "Quantized weights").
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_gemm import linear_int8_packed, pack_linear_weight_int8
from kernels.reference import quantize_int8_per_channel

KEEP_FLOAT = ("lm_head",)  # module names that stay in the compute dtype


class Int8Linear(nn.Module):
    """``nn.Linear`` inference twin with an int8 weight: ``[..., in_features] -> [..., out_features]`` float32.

    Built from a float32 CPU ``nn.Linear``: ``packed_weight`` int8 ``[ceil(out / W), in, W]``, ``scales``
    float32 ``[out_features]``; the bias (if any) stays float32 and shared.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        qweight, scales = quantize_int8_per_channel(linear.weight)
        self.packed_weight = nn.Buffer(pack_linear_weight_int8(qweight), persistent=False)
        self.scales = nn.Buffer(scales, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return linear_int8_packed(x, self.packed_weight, self.scales, self.out_features, bias)


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` except the LM head by an :class:`Int8Linear`, in place.

    Call after the weights are loaded, before :func:`~worker.engine.executor.layers.linear.pack_linear_layers`
    (which then packs what stayed float32).

    Returns:
        The number of layers replaced.

    Raises:
        ValueError: when int8 cannot run here: the C++ CPU kernels are unavailable (disabled or not built), or
            a linear weight is not float32 on CPU (name and dtype/device given).
    """
    if not cpu_kernels_available():
        raise ValueError("quantization 'int8' needs the C++ CPU kernels, which are unavailable or disabled here")
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or name in KEEP_FLOAT:
                continue
            if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                full_name = f"{parent_name}.{name}".lstrip(".")
                raise ValueError(
                    f"quantization 'int8' runs float32 models on CPU; {full_name} is "
                    f"{child.weight.dtype} on {child.weight.device}"
                )
            setattr(parent, name, Int8Linear(child))
            replaced += 1
    return replaced

"""Weight-only int8 linear layers for float32 models on CPU: GGUF Q8_0 blocks made at load.

Decode reads every weight once per step, so at small batches its speed is bytes moved: int8 weights are about a
quarter of float32's. Each ``nn.Linear`` of a decoder layer (q/k/v, o, gate/up, down) is quantized at load to
llama.cpp's Q8_0 blocks (:func:`kernels.reference.quantize_q8_0`: int8 with one float16 scale per group of 32
weights along ``in_features``, 34 bytes per 32 weights) and run by the GGUF kernel
(:class:`~worker.engine.executor.layers.quantization.q4.GGUFLinear`, :func:`kernels.cpu_q4.linear_gguf`) with
float32 activations, each block dequantized in registers (the issue's fallback for CPUs without VNNI or
AMX-INT8, which is every CPU here). One scale per group of 32 rather than per output channel: per-channel
scales agreed with float32's top-1 at 98.11% of 8,192 HumanEval positions, groups of 32 at 98.63%, and the
group kernel measured as fast (docs/engine.md, "Quantized weights"). The embeddings, the norms and the LM head
stay float32 (the LM head reads the tied embedding in SmolLM2, and its logits decide the token); a layer
whose ``in_features`` is not a multiple of 32 stays float32 too.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_q4 import GGUF_BLOCK_SIZE, GGUF_BLOCK_TYPES
from kernels.reference import quantize_q8_0
from worker.engine.executor.layers.quantization.q4 import GGUFLinear

KEEP_FLOAT = ("lm_head",)  # module names that stay in the compute dtype
Q8_0 = GGUF_BLOCK_TYPES["Q8_0"]


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` except the LM head (and layers whose ``in_features`` is not a
    multiple of 32) by a Q8_0 :class:`~worker.engine.executor.layers.quantization.q4.GGUFLinear`, in place.

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
            if not isinstance(child, nn.Linear) or name in KEEP_FLOAT or child.in_features % GGUF_BLOCK_SIZE:
                continue
            if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                full_name = f"{parent_name}.{name}".lstrip(".")
                raise ValueError(
                    f"quantization 'int8' runs float32 models on CPU; {full_name} is "
                    f"{child.weight.dtype} on {child.weight.device}"
                )
            setattr(parent, name, GGUFLinear(quantize_q8_0(child.weight), Q8_0, child.in_features, child.bias))
            replaced += 1
    return replaced

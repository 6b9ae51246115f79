"""Weight quantization schemes, one module per scheme (issue #27; docs/engine.md, "Quantized weights").

``quantization`` (engine config, ``BATCHINFER_QUANTIZATION``) is ``"none"`` (weights in the compute dtype),
``"int8"`` (:mod:`.int8`: weight-only int8 with per-output-channel scales, float32 activations) or ``"q4"``
(:mod:`.q4`: the GGUF's own Q4_0/Q4_1/Q8_0 blocks, or Q4_1 made at load from an HF folder; float32 models, or
bfloat16 ones on a CPU with AVX512_BF16).
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("none", "int8", "q4")


def check_quantization(quantization: str) -> str:
    """``quantization`` if it is served here.

    Raises:
        ValueError: naming the unknown value; the message lists the served ones.
    """
    if quantization in QUANTIZATION_METHODS:
        return quantization
    served = ", ".join(repr(method) for method in QUANTIZATION_METHODS)
    raise ValueError(f"quantization must be one of {served}, got {quantization!r}")

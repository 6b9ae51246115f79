"""Weight quantization schemes, one module per scheme (issue #27; docs/engine.md, "Quantized weights").

``quantization`` (engine config, ``BATCHINFER_QUANTIZATION``) is ``"none"`` (weights in the compute dtype)
or ``"int8"`` (:mod:`.int8`: weight-only int8 with per-output-channel scales, float32 activations). ``"q4"``
(the GGUF's own 4-bit blocks) is named by the issue but not served yet and is refused with that reason.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("none", "int8")
NOT_YET_SERVED = ("q4",)


def check_quantization(quantization: str) -> str:
    """``quantization`` if it is served here.

    Raises:
        ValueError: naming the value: one not served yet (``q4``) or unknown; the message lists the served ones.
    """
    if quantization in QUANTIZATION_METHODS:
        return quantization
    served = ", ".join(repr(method) for method in QUANTIZATION_METHODS)
    if quantization in NOT_YET_SERVED:
        raise ValueError(f"quantization {quantization!r} is not yet served; use one of {served}")
    raise ValueError(f"quantization must be one of {served}, got {quantization!r}")

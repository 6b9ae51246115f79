"""Phi-3 (Abdin et al. 2024): Llama-shaped, with q/k/v and gate/up already fused in the checkpoint.

Names match ours (``self_attn.qkv_proj``, ``mlp.gate_up_proj``, q then k then v, gate then up), so
tensors load as they are. ``partial_rotary_factor`` (Phi-4-mini) and ``longrope`` scaling (the 128k
variants: short and long factor sets, chosen per token by its prompt's length and position as Hugging
Face's ``generate`` does) are handled by :class:`~worker.engine.executor.models.llama.RotaryEmbedding`
and :func:`~worker.engine.executor.models.llama.long_rope_positions`; a ``sliding_window`` (Phi-3-mini-4k
sets 2047) windows every layer.
"""

from __future__ import annotations

from typing import ClassVar

from worker.engine.executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``Phi3ForCausalLM`` over a flat ragged batch (no biases, no q/k norm)."""

    checkpoint_is_fused: ClassVar[bool] = True

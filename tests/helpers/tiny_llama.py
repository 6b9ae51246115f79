"""A tiny random Llama checkpoint (GQA, byte-level tokenizer) saved as a Hugging Face folder, for fast tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Same ChatML layout as SmolLM2-Instruct (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The tiny decoder every family's test model shares (tests/helpers/tiny_models.py adds each family's own).
TINY_DECODER_FIELDS: dict[str, Any] = dict(
    vocab_size=len(SPECIAL_TOKENS) + 256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """2 layers, hidden 64, 4 heads / 2 KV heads (GQA, head_size 16), vocab 259; ``overrides`` win.

    The vocabulary is exactly :func:`build_byte_tokenizer`'s, so every sampled id decodes: ids 0..2 are
    the special tokens (``<|endoftext|>`` = pad, ``<|im_start|>`` = bos, ``<|im_end|>`` = eos), 3..258
    the 256 byte symbols.
    """
    return LlamaConfig(**{**TINY_DECODER_FIELDS, "rope_theta": 10000.0, **overrides})


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with no merges: ids 0..2 special (see :data:`SPECIAL_TOKENS`), 3..258 bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: idx for idx, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + idx for idx, char in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_llama(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a randomly initialised tiny Llama (+ tokenizer) as a Hugging Face folder at ``path``.

    Weights are ``model.safetensors`` (float32). Deterministic for a given ``seed``. The random init is
    widened (std 0.1 instead of 0.02) so that greedy decoding does not collapse onto one token.

    Returns:
        ``path`` as a :class:`Path` (created if needed).
    """
    path = Path(path)
    config = tiny_llama_config(initializer_range=0.1, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path

"""The raw bytes of one token, for chat ``logprobs`` ``bytes``.

OpenAI's ``bytes`` lets a client rebuild text whose characters span several tokens, so a token that
holds part of a multi-byte character (a CJK character, an emoji) must report its own bytes, not the
U+FFFD its lone decoding shows. A byte-level BPE tokenizer (GPT-2 style, as SmolLM2's) stores each
byte as one printable character of GPT-2's ``bytes_to_unicode`` alphabet; mapping the token's
characters back through that alphabet gives its bytes.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Protocol

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode


class TokenStore(Protocol):
    """The slice of a Hugging Face (fast) tokenizer this module uses."""

    backend_tokenizer: Any

    @property
    def added_tokens_decoder(self) -> dict[int, Any]: ...

    def convert_ids_to_tokens(self, ids: int) -> str: ...


@cache
def _byte_of_char() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]


class TokenBytes:
    """Maps a token id to its raw bytes for one tokenizer.

    Byte-level BPE tokens are mapped back through the byte alphabet. Added tokens (special ones such
    as ``<|im_end|>``) are stored as plain text, and a tokenizer of another kind is not byte-level:
    for those, the bytes are the UTF-8 of the token's decoded text.
    """

    def __init__(self, tokenizer: TokenStore) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self._added_ids = frozenset(tokenizer.added_tokens_decoder) if self._byte_level else frozenset()

    def __call__(self, token_id: int, decoded_token: str) -> bytes:
        """The bytes of ``token_id``; ``decoded_token`` is its decoded text (used where tokens are not bytes)."""
        if not self._byte_level or token_id in self._added_ids:
            return decoded_token.encode("utf-8")
        byte_of_char = _byte_of_char()
        return bytes(byte_of_char[char] for char in self._tokenizer.convert_ids_to_tokens(token_id))

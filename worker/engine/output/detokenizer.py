"""Incremental detokenization: text grows token by token and never ends in a broken character.

The method is vLLM's ``detokenize_incrementally`` (prefix_offset / read_offset): decode a short window of
already-emitted tokens (the prefix) alone and together with the new tokens; the new text is the
difference. The window gives tokenizers that drop a word's leading space at the start of a decode
(SentencePiece) the context they need, and a decode that ends in U+FFFD (an incomplete UTF-8 sequence,
e.g. the first of the byte tokens ``<0xE4><0xBD><0xA0>`` or GPT-2 byte-level pieces) is held back until
the character is complete.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as context for the first output.
_INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence's output tokens as they are generated.

    ``append`` returns only newly completed text; the concatenation of its results (plus ``flush()`` at
    the end) equals ``tokenizer.decode(output_token_ids, skip_special_tokens=...)`` for byte-level BPE
    tokenizers, CJK and emoji included. Special tokens are dropped when ``skip_special_tokens``.
    """

    __slots__ = (
        "_output_text",
        "_prefix_offset",
        "_read_offset",
        "_skip_special_tokens",
        "_special_ids",
        "_token_ids",
        "_tokenizer",
    )

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._special_ids = frozenset(tokenizer.all_special_ids)
        # Context: the last few prompt tokens, special ones excluded when they would be skipped anyway.
        context = prompt_token_ids[-(_INITIAL_PREFIX_TOKENS + 2) :]
        if skip_special_tokens:
            context = [t for t in context if t not in self._special_ids]
        self._token_ids: list[int] = list(context)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(self._read_offset - _INITIAL_PREFIX_TOKENS, 0)
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (complete characters only)."""
        return self._output_text

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly ``""``)."""
        if self._skip_special_tokens and token_id in self._special_ids:
            return ""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._output_text += delta
        return delta

    def flush(self) -> str:
        """Emit text still held back (a trailing incomplete character decodes to U+FFFD); call at finish."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        assert isinstance(text, str)  # one id list decodes to one string
        return text


def decode_token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """Text of one token for a logprob entry (special tokens shown, a partial character as U+FFFD)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    assert isinstance(text, str)  # one id list decodes to one string
    return text

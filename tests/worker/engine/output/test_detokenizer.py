"""Incremental detokenization with the real SmolLM2 tokenizer (GPT-2 byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.engine.output.detokenizer import IncrementalDetokenizer, decode_token

TEXTS = [
    "你好，世界！这是一个测试。日本語のテキストも大丈夫です。",
    "Emoji: 🎉👍🏽👨‍👩‍👧 and flags 🇫🇷🇯🇵 done",
    "Mixed: café naïve — 中文 with English 😀, code `x = 1`\n\tnext line, Ελληνικά, русский.",
]


@pytest.fixture(scope="module")
def tokenizer(served_tokenizer):
    """The served model's tokenizer (tests/worker/conftest.py: SmolLM2, converted once from its GGUF)."""
    return served_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    chat = [{"role": "user", "content": "Say something."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> tuple[IncrementalDetokenizer, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return detokenizer, [detokenizer.append(t) for t in output_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_increments_concatenate_to_the_one_shot_decode(tokenizer, prompt_ids, text):
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    # The test is only meaningful if some characters are split over several byte-level tokens.
    assert any(decode_token(tokenizer, t).endswith("\ufffd") for t in output_ids)
    detokenizer, increments = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(increments) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert detokenizer.output_text == text
    assert not any("\ufffd" in piece for piece in increments)
    assert detokenizer.flush() == ""


def test_leading_space_of_the_first_output_token_is_kept(tokenizer, prompt_ids):
    output_ids = tokenizer.encode(" Paris is nice.", add_special_tokens=False)
    _, increments = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(increments) == " Paris is nice."


def test_a_character_split_over_tokens_is_held_back_until_complete(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(output_ids) > 1
    _, increments = stream(tokenizer, prompt_ids, output_ids)
    assert increments[:-1] == [""] * (len(output_ids) - 1)
    assert increments[-1] == "世"


def test_flush_emits_a_trailing_incomplete_character_like_decode(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("ok 世", add_special_tokens=False)[:-1]
    detokenizer, increments = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(increments) == "ok "
    tail = detokenizer.flush()
    assert "".join(increments) + tail == tokenizer.decode(output_ids) == detokenizer.output_text
    assert tail.endswith("\ufffd")


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer, prompt_ids):
    body = tokenizer.encode("Hi 你好", add_special_tokens=False)
    output_ids = body[:2] + [tokenizer.eos_token_id] + body[2:] + [tokenizer.eos_token_id]
    _, skipped = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(skipped) == tokenizer.decode(output_ids, skip_special_tokens=True)
    _, kept = stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=False)
    assert "".join(kept) == tokenizer.decode(output_ids, skip_special_tokens=False)
    assert "".join(kept).endswith("<|im_end|>")


def test_decode_token_for_logprob_entries(tokenizer):
    assert decode_token(tokenizer, tokenizer.eos_token_id) == "<|im_end|>"
    (hello,) = tokenizer.encode(" Hello", add_special_tokens=False)
    assert decode_token(tokenizer, hello) == " Hello"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(output_ids=st.lists(st.integers(min_value=0, max_value=400), min_size=1, max_size=24))
def test_any_token_stream_plus_flush_equals_decode(tokenizer, prompt_ids, output_ids):
    # Low ids are single bytes and short pieces: arbitrary, often invalid, UTF-8 splits and special tokens.
    detokenizer, increments = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(increments) + detokenizer.flush() == tokenizer.decode(output_ids, skip_special_tokens=True)
    assert not any(piece.endswith("\ufffd") for piece in increments)

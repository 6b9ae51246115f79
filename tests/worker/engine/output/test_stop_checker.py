"""Stop strings across token boundaries, stop tokens, EOS, min/max tokens (vLLM's StopChecker semantics)."""

from __future__ import annotations

import pytest

from worker.engine.output.detokenizer import IncrementalDetokenizer
from worker.engine.output.stop_checker import FinishState, StopStringMatch, check_finish, find_stop_string
from worker.engine.sampling_params import SamplingParams

EOS = 2
MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def tokenizer(served_tokenizer):
    return served_tokenizer


def generate(tokenizer, text: str, params: SamplingParams, prompt_len: int = 10) -> tuple[FinishState | None, int]:
    """Feed ``text``'s tokens one by one as the engine would; return the finish state and tokens used."""
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Answer:", add_special_tokens=False))
    for n, token_id in enumerate(output_ids, start=1):
        new_text = detokenizer.append(token_id)
        state = check_finish(
            params=params,
            last_token_id=token_id,
            num_output_tokens=n,
            num_prompt_tokens=prompt_len,
            max_model_len=MAX_MODEL_LEN,
            eos_token_id=EOS,
            output_text=detokenizer.output_text,
            new_char_count=len(new_text),
        )
        if state is not None:
            return state, n
    return None, len(output_ids)


def test_stop_string_ending_mid_token_is_cut_exactly(tokenizer):
    text = "The capital of France is Paris. It is big."
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert " Paris" in pieces  # "Par" ends inside this token
    state, _ = generate(tokenizer, text, SamplingParams(stop=["Par"]))
    assert state == FinishState(finish_reason="stop", stop_reason="Par", output_text="The capital of France is ")


def test_stop_string_spanning_several_tokens_is_cut_exactly(tokenizer):
    text = "The capital of France is Paris. It is big."
    state, used = generate(tokenizer, text, SamplingParams(stop=["of France is P"]))
    assert state is not None and state.output_text == "The capital "
    assert state.stop_reason == "of France is P"
    # It stopped on the token that completed the stop string, not before and not later.
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "of France is P" in tokenizer.decode(ids[:used])
    assert "of France is P" not in tokenizer.decode(ids[: used - 1])


def test_stop_string_included_when_asked(tokenizer):
    params = SamplingParams(stop=["Par"], include_stop_str_in_output=True)
    state, _ = generate(tokenizer, "The capital of France is Paris.", params)
    assert state is not None and state.output_text == "The capital of France is Par"


def test_cjk_stop_string_split_across_byte_tokens(tokenizer):
    state, _ = generate(tokenizer, "你好世界，再见", SamplingParams(stop=["世界"]))
    assert state is not None and (state.output_text, state.stop_reason) == ("你好", "世界")


def test_the_stop_string_completed_first_wins():
    # "y" completes before "xyz" would, whatever the token split.
    assert find_stop_string("axyz", 3, ["xyz", "y"]) == StopStringMatch(text="ax", stop_str="y")
    assert find_stop_string("axyz", 3, ["yz", "xyz"]) == StopStringMatch(text="a", stop_str="xyz")


def test_only_occurrences_ending_in_the_new_text_count():
    assert find_stop_string("stop then more", 5, ["stop"]) is None
    assert find_stop_string("abc", 0, ["abc"]) is None
    assert find_stop_string("abcd", 1, ["bcd", ""]) == StopStringMatch(text="a", stop_str="bcd")


def finish(params: SamplingParams, token_id: int, n: int, text: str = "", new: int = 0, prompt: int = 10):
    return check_finish(
        params=params,
        last_token_id=token_id,
        num_output_tokens=n,
        num_prompt_tokens=prompt,
        max_model_len=32,
        eos_token_id=EOS,
        output_text=text,
        new_char_count=new,
    )


def test_eos_stops_unless_ignored():
    assert finish(SamplingParams(), EOS, 3, "abc", 0) == FinishState("stop", None, "abc")
    assert finish(SamplingParams(ignore_eos=True), EOS, 3, "abc", 0) is None


def test_eos_text_is_removed_when_special_tokens_are_kept():
    state = finish(SamplingParams(skip_special_tokens=False), EOS, 2, "hi<|im_end|>", len("<|im_end|>"))
    assert state == FinishState("stop", None, "hi")


def test_stop_token_id_reports_the_id():
    assert finish(SamplingParams(stop_token_ids=[7]), 7, 3, "abc", 1) == FinishState("stop", 7, "ab")
    kept = finish(SamplingParams(stop_token_ids=[7], include_stop_str_in_output=True), 7, 3, "abc", 1)
    assert kept == FinishState("stop", 7, "abc")


def test_min_tokens_defers_every_stop_but_length():
    params = SamplingParams(min_tokens=4, stop=["b"], stop_token_ids=[7])
    assert finish(params, EOS, 3) is None
    assert finish(params, 7, 3) is None
    assert finish(params, 5, 3, "ab", 1) is None
    assert finish(params, 7, 4) == FinishState("stop", 7, "")


def test_max_tokens_and_context_limit_give_length():
    assert finish(SamplingParams(max_tokens=3), 5, 2, "ab", 1) is None
    assert finish(SamplingParams(max_tokens=3), 5, 3, "abc", 1) == FinishState("length", None, "abc")
    assert finish(SamplingParams(max_tokens=None), 5, 21, prompt=10) is None
    assert finish(SamplingParams(max_tokens=None), 5, 22, prompt=10) == FinishState("length", None, "")


def test_a_stop_on_the_last_allowed_token_reports_stop():
    assert finish(SamplingParams(max_tokens=3), EOS, 3, "ab", 0) == FinishState("stop", None, "ab")
    assert finish(SamplingParams(max_tokens=3, stop=["b"]), 5, 3, "ab", 1) == FinishState("stop", "b", "a")

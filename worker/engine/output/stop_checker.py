"""When a sequence finishes: EOS, stop token ids, stop strings, ``max_tokens`` and the context limit.

Pure functions the engine calls once per sequence per step, after appending the sampled token and
its detokenized text. Semantics follow vLLM's ``StopChecker`` (V0): nothing stops a sequence before
``min_tokens`` output tokens except the length limits; EOS (unless ``ignore_eos``) and ``stop_token_ids``
stop with the token kept in ``token_ids`` and its text removed; a stop string stops with the text cut
before it (or after it with ``include_stop_str_in_output``); otherwise ``max_tokens`` or a full context
gives ``"length"``. A stop condition met on the last allowed token reports ``"stop"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.outputs import FinishReason
from worker.engine.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class StopStringMatch:
    """A stop string found in the output: the text to keep and the string that matched."""

    text: str
    stop_str: str


@dataclass(slots=True, frozen=True)
class FinishState:
    """Why and with what text a sequence finished.

    ``stop_reason`` is the matched stop string, the stop token id, or ``None`` (EOS, length).
    ``output_text`` is the final text: the input text, or that text with the stop string / stop token
    text cut off.
    """

    finish_reason: FinishReason
    stop_reason: str | int | None
    output_text: str


def find_stop_string(
    output_text: str, new_char_count: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopStringMatch | None:
    """Find the first stop string to complete within the newly appended text.

    Only occurrences that end inside the last ``new_char_count`` characters count (earlier ones were
    checked on earlier steps); they may start in older text, so a stop string can span tokens and end in
    the middle of one. Among several, the one that ends first wins (ties: the longer one), which is the
    answer a character-by-character stream would give, so the result does not depend on how the text
    was split into tokens.

    Args:
        output_text: all output text so far, the new text included.
        new_char_count: length of the text appended this step.
        stop: the stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the stop string at the end of the returned text.

    Returns:
        the truncated text and the matched string, or ``None``.
    """
    if new_char_count <= 0 or not stop:
        return None
    new_start = len(output_text) - new_char_count
    best: tuple[int, int, str] | None = None
    for stop_str in stop:
        if not stop_str:
            continue
        start = output_text.find(stop_str, max(new_start - len(stop_str) + 1, 0))
        if start == -1:
            continue
        end = start + len(stop_str)
        if best is None or (end, start) < (best[0], best[1]):
            best = (end, start, stop_str)
    if best is None:
        return None
    end, start, stop_str = best
    return StopStringMatch(text=output_text[: end if include_stop_str_in_output else start], stop_str=stop_str)


def check_finish(
    *,
    params: SamplingParams,
    last_token_id: int,
    num_output_tokens: int,
    num_prompt_tokens: int,
    max_model_len: int,
    eos_token_id: int | None,
    output_text: str = "",
    new_char_count: int = 0,
) -> FinishState | None:
    """Decide whether a sequence is finished after appending its latest token.

    Args:
        params: the request's sampling parameters.
        last_token_id: the token just appended.
        num_output_tokens: output tokens so far, the new one included.
        num_prompt_tokens: prompt length in tokens.
        max_model_len: context limit; a sequence of this many tokens cannot grow.
        eos_token_id: the tokenizer's EOS id (``None``: no EOS check).
        output_text: detokenized output so far, the new token's text included (needed for stop strings).
        new_char_count: characters the new token added to ``output_text``.

    Returns:
        the finish state, or ``None`` while the sequence should continue.
    """
    if num_output_tokens >= params.min_tokens:
        stopped_by_token = (not params.ignore_eos and last_token_id == eos_token_id) or (
            last_token_id in params.stop_token_ids
        )
        if stopped_by_token:
            text = output_text
            if new_char_count and not params.include_stop_str_in_output:
                text = output_text[: len(output_text) - new_char_count]
            stop_reason = None if last_token_id == eos_token_id and not params.ignore_eos else last_token_id
            return FinishState(finish_reason="stop", stop_reason=stop_reason, output_text=text)
        match = find_stop_string(output_text, new_char_count, params.stop, params.include_stop_str_in_output)
        if match is not None:
            return FinishState(finish_reason="stop", stop_reason=match.stop_str, output_text=match.text)
    if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or (
        num_prompt_tokens + num_output_tokens >= max_model_len
    ):
        return FinishState(finish_reason="length", stop_reason=None, output_text=output_text)
    return None

"""Shard planning at validation: sizes by estimated tokens, shared prefixes kept together, every line once."""

from __future__ import annotations

import pytest

from jobs.sharding import (
    KEEP_TOGETHER_CHARS,
    MAX_LINE_SHARE,
    MAX_OVERSHOOT,
    batch_priority,
    estimate_tokens,
    plan_shards,
    prompt_text,
    sketch_line,
)
from jobs.validation import ValidatedLine


def _line(n: int, prompt: str, **body) -> ValidatedLine:
    return ValidatedLine(n, f"c{n}", {"model": "m", "prompt": prompt, **body})


def test_estimates_prompt_characters_and_completion_budget():
    assert estimate_tokens({"prompt": "x" * 40, "max_tokens": 10}) == 10 + 10
    assert estimate_tokens({"prompt": "x" * 40}) == 10 + 16  # /v1/completions' default max_tokens
    assert estimate_tokens({"messages": [{"role": "user", "content": "hi"}], "n": 2}) == 2 + 2 * 256
    assert estimate_tokens({"messages": [], "max_completion_tokens": 7, "max_tokens": 99}) == 1 + 7
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 1, "best_of": 3, "n": 1}) == 2 + 3
    assert prompt_text({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}) == (
        "system: S\nuser: U"
    )


def test_a_responses_line_is_estimated_like_a_chat_line():
    body = {"instructions": "S", "input": "U" * 8}
    assert prompt_text(body) == "system: S\nuser: UUUUUUUU"
    assert estimate_tokens(body) == len("system: S\nuser: UUUUUUUU") // 4 + 256
    assert estimate_tokens({**body, "max_output_tokens": 5}) == len("system: S\nuser: UUUUUUUU") // 4 + 5
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert prompt_text({"input": messages}).startswith("user: [")


def test_every_line_in_exactly_one_shard_near_the_target():
    lines = [_line(n, f"prompt number {n:04d}", max_tokens=20) for n in range(1, 101)]  # 5 + 20 tokens each
    by_number = {line.line_number: line for line in lines}
    shards = plan_shards([sketch_line(line) for line in lines], target_tokens=250)
    assert sorted(n for shard in shards for n in shard.line_numbers) == list(range(1, 101))
    assert len(shards) == 10
    for shard in shards:
        assert shard.num_tokens == sum(estimate_tokens(by_number[n].body) for n in shard.line_numbers)
        assert shard.line_numbers == sorted(shard.line_numbers)
    assert plan_shards([sketch_line(line) for line in lines], target_tokens=10**9)[0].line_numbers == list(
        range(1, 101)
    )


def test_lines_sharing_a_prefix_stay_together_up_to_the_overshoot():
    preamble = "You are a careful assistant. " * 4
    assert len(preamble) >= KEEP_TOGETHER_CHARS
    shared = [_line(n, f"{preamble}question {n}", max_tokens=10) for n in range(1, 13)]
    loners = [_line(n, f"unrelated {n}", max_tokens=10) for n in range(13, 17)]
    lines = [line for pair in zip(shared, loners, strict=False) for line in pair] + shared[4:]
    target = 2 * estimate_tokens(shared[0].body)
    shards = plan_shards([sketch_line(line) for line in lines], target_tokens=target)
    shared_numbers = {line.line_number for line in shared}
    holding = [shard for shard in shards if shared_numbers & set(shard.line_numbers)]
    assert len(holding) == 1 + (12 * estimate_tokens(shared[0].body) - 1) // (MAX_OVERSHOOT * target)
    for shard in shards:
        assert set(shard.line_numbers) <= shared_numbers or not shared_numbers & set(shard.line_numbers)


def test_a_line_with_a_huge_budget_does_not_push_its_neighbours_into_a_later_shard():
    # max_tokens far beyond any context: the engine stops it at the context limit, so it must not count as
    # a whole shard, which would send the lines sorted after it to the next shard, behind its generation.
    lines = [
        _line(1, "c one", max_tokens=3),
        _line(2, "b", max_tokens=100_000),
        _line(3, "a one", max_tokens=3),
        _line(4, "c two", max_tokens=3),
    ]
    shards = plan_shards([sketch_line(line) for line in lines], target_tokens=65_536)
    assert [shard.line_numbers for shard in shards] == [[1, 2, 3, 4]]
    assert shards[0].num_tokens == int(MAX_LINE_SHARE * 65_536) + 3 * estimate_tokens(lines[0].body)
    # Two such lines still fill a shard: the next line starts another.
    many = [_line(n, f"long {n}", max_tokens=10**12) for n in range(1, 6)]
    assert [shard.line_numbers for shard in plan_shards([sketch_line(line) for line in many], target_tokens=100)] == [
        [1, 2],
        [3, 4],
        [5],
    ]


def test_priority_comes_from_metadata():
    assert batch_priority(None) == 0 and batch_priority({"k": "v"}) == 0
    assert batch_priority({"priority": "5"}) == 5 and batch_priority({"priority": "-2"}) == -2
    with pytest.raises(ValueError):
        batch_priority({"priority": "urgent"})
    with pytest.raises(ValueError):
        plan_shards([], target_tokens=0)

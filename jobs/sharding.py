"""Cut a validated batch into shards: groups of lines one worker runs at a time (docs/operations.md).

The API plans the shards at validation, without a tokenizer (the API process loads no model), so
sizes are estimates:

- a line's tokens = its prompt text's characters / 4 (a common rule of thumb for English text under
  BPE vocabularies) + its completion budget (``max_completion_tokens`` / ``max_tokens`` /
  ``max_output_tokens``, else 16 on ``/v1/completions`` as OpenAI, else 256 on chat and Responses
  lines) times the number of samples (``best_of`` or ``n``);
- lines are ordered by their prompt text (its first ``SORT_KEY_CHARS`` characters), so lines that share a
  prefix are adjacent (a sorted order
  puts every set of strings with a common prefix in one run, as the worker's own token-id order does,
  docs/engine.md "Prefix caching");
- a shard is closed once it holds ``target_tokens``, but not between two lines whose prompt texts
  share their first ``KEEP_TOGETHER_CHARS`` characters (they would hit the same cached prefix), up to
  ``MAX_OVERSHOOT`` times the target, where it is closed anyway;
- a line counts for at most ``MAX_LINE_SHARE`` of the target: the engine stops a sample at the context
  limit whatever its ``max_tokens`` asks, and one line sized at a whole shard would close its shard and
  push the lines sorted after it into the next one, to wait until its long generation ends.

The plan reads one small :class:`LineSketch` per line (line number, sort key, size), never the bodies,
so a 50,000-line file is planned in a few megabytes. Pure functions: no database, no engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.schemas import COMPLETIONS_DEFAULT_MAX_TOKENS
from jobs.validation import ValidatedLine

CHARS_PER_TOKEN = 4
CHAT_COMPLETION_BUDGET = 256
KEEP_TOGETHER_CHARS = 64
SORT_KEY_CHARS = 256
MAX_OVERSHOOT = 4
MAX_LINE_SHARE = 0.5


@dataclass(slots=True, frozen=True)
class LineSketch:
    """What the plan needs of a line: its number, the start of its prompt text and its estimated tokens."""

    line_number: int
    key: str
    num_tokens: int


@dataclass(slots=True)
class PlannedShard:
    """One shard's line numbers (ascending) and its estimated size in tokens (each line's estimate, capped
    at ``MAX_LINE_SHARE`` of the target)."""

    line_numbers: list[int] = field(default_factory=list)
    num_tokens: int = 0


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a line's prompt starts with: chat messages as ``role: content`` lines (a Responses
    line's ``instructions`` and ``input`` likewise), or the completion prompt (token ids as JSON). Used
    to order lines and to estimate their size."""
    messages = body.get("messages")
    if "input" in body:
        given = body["input"]
        instructions = body.get("instructions")
        messages = ([{"role": "system", "content": instructions}] if isinstance(instructions, str) else []) + (
            [{"role": "user", "content": given}] if isinstance(given, str) else given if isinstance(given, list) else []
        )
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
            parts.append(f"{message.get('role')}: {text}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def estimate_tokens(body: Mapping[str, Any]) -> int:
    """A line's estimated tokens: prompt characters / 4 (at least 1) + completion budget x samples."""
    budget = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if not isinstance(budget, int) or budget <= 0:
        budget = CHAT_COMPLETION_BUDGET if "messages" in body or "input" in body else COMPLETIONS_DEFAULT_MAX_TOKENS
    samples = body.get("best_of") or body.get("n") or 1
    if not isinstance(samples, int) or samples <= 0:
        samples = 1
    return max(1, len(prompt_text(body)) // CHARS_PER_TOKEN) + budget * samples


def sketch_line(line: ValidatedLine) -> LineSketch:
    """The :class:`LineSketch` of a validated line."""
    return LineSketch(line.line_number, prompt_text(line.body)[:SORT_KEY_CHARS], estimate_tokens(line.body))


def plan_shards(lines: Sequence[LineSketch], *, target_tokens: int) -> list[PlannedShard]:
    """Group ``lines`` into shards of about ``target_tokens`` estimated tokens (see the module docstring).

    Every line lands in exactly one shard; no shard is empty; each shard's line numbers ascend.
    O(n log n) in the number of lines.

    Raises:
        ValueError: ``target_tokens`` is not positive.
    """
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    max_line_tokens = max(1, int(MAX_LINE_SHARE * target_tokens))
    shards: list[PlannedShard] = []
    current = PlannedShard()
    previous_key = ""
    for line in sorted(lines, key=lambda sketch: sketch.key):
        if current.line_numbers and current.num_tokens >= target_tokens:
            shares_prefix = previous_key[:KEEP_TOGETHER_CHARS] == line.key[:KEEP_TOGETHER_CHARS]
            if not shares_prefix or current.num_tokens >= MAX_OVERSHOOT * target_tokens:
                shards.append(current)
                current = PlannedShard()
        current.line_numbers.append(line.line_number)
        current.num_tokens += min(line.num_tokens, max_line_tokens)
        previous_key = line.key
    if current.line_numbers:
        shards.append(current)
    for shard in shards:
        shard.line_numbers.sort()
    return shards


def batch_priority(metadata: Mapping[str, str] | None) -> int:
    """The batch's ``metadata["priority"]`` as an integer (higher runs first); 0 when absent.

    Raises:
        ValueError: present but not a whole number.
    """
    if not metadata or "priority" not in metadata:
        return 0
    return int(metadata["priority"])

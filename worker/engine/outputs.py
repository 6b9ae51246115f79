"""What the engine returns per request (vLLM's `RequestOutput` / `CompletionOutput` shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class Logprob:
    """Log-softmax of the raw logits at one position for one token id."""

    logprob: float
    decoded_token: str


# One entry per position: token id -> Logprob (the chosen token plus the top alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (one of ``n`` samples, or one beam).

    ``text`` is the detokenized output with any matched stop string removed (unless
    ``include_stop_str_in_output``); ``stop_reason`` is the matched stop string or stop token id.
    ``cumulative_logprob`` (sum of the sampled tokens' raw logprobs) and ``logprobs`` are ``None`` unless
    the request asked for logprobs, as in vLLM.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestMetrics:
    """When a request passed each stage, in `time.monotonic` seconds (vLLM's ``RequestMetrics`` fields).

    ``first_scheduled_time`` is its first step in the batch (``- arrival_time`` = queue time);
    ``first_token_time`` and ``last_token_time`` are the ends of the steps that sampled its first and
    last tokens (the earliest sequence's first token, the latest sequence's last, when ``n > 1``);
    ``finished_time`` is when the step that finished it returned.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """How far an unfinished request got (`LLMEngine.progress`): what a checkpoint stores.

    ``num_generated_tokens`` counts the tokens sampled so far over all its sequences (resumed ones
    included); ``resumable_token_ids`` is its one sequence's output so far, from which it can resume
    (``add_request(..., resumed_token_ids=...)``), or None when it cannot (`core.request.can_resume`).
    """

    num_generated_tokens: int
    resumable_token_ids: list[int] | None


@dataclass(slots=True)
class RequestOutput:
    """State of one request after an engine step; ``finished`` once every sequence is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

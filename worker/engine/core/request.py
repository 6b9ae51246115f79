"""Requests and their sequences: the token streams the scheduler moves between queues (pure Python).

A :class:`Request` is one prompt plus its :class:`~worker.engine.sampling_params.SamplingParams`; it owns
one :class:`Sequence` per branch (``n`` samples, or ``best_of`` of them; one for greedy, whose samples
are all the same). Only the first branch prefills the prompt; the others wait in its ``pending_forks``
and are forked off it (sharing its KV blocks, copy-on-write) when its prefill completes, each then
sampling its own first token from the same logits (vLLM V0's parallel sampling). The scheduler and the
KV cache manager only ever see sequences. The request finishes when all its sequences do.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.outputs import FinishReason, PositionLogprobs, RequestMetrics
from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.core.beam_search import BeamSearchState
    from worker.engine.output.detokenizer import IncrementalDetokenizer
    from worker.engine.structured_output.backend_xgrammar import StructuredOutputGrammar


class SequenceStatus(enum.Enum):
    """Where a sequence is: the waiting queue, the running batch, back in waiting after preemption, or done;
    ``FORK_PENDING``: in no queue, waiting to be forked off its request's first branch."""

    FORK_PENDING = enum.auto()
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream (one sample of a request).

    ``token_ids`` is prompt + output so far; ``num_computed_tokens`` counts the leading tokens whose K/V
    sit in the KV cache (the scheduler schedules ``num_tokens - num_computed_tokens`` more: the rest of
    the prompt while prefilling, then one per decode step; after preemption it restarts at 0 and the
    generated tokens are recomputed as if they were prompt). ``output_text`` is set at finish (stop
    handling applied). ``num_cached_tokens`` is how many prompt tokens the prefix cache supplied at first admission.
    ``pending_forks`` are the request's other branches, forked off this sequence once its prompt is computed.
    ``cache_salt`` (None: unsalted) keeps the prefix cache from sharing this sequence's blocks with any other
    (core/kv_cache_manager.py; set on branches when forks are disabled).
    ``spec_token_ids`` are draft tokens proposed for this step (speculative decoding, docs/engine.md,
    "Speculative decoding"): the scheduler schedules them after the last token and the step verifies them;
    they are never part of ``token_ids`` until accepted. ``spec_parent_idx`` is None for a chain of drafts, or the
    parents of a draft tree (``DraftProposal.parent_idx``), one per ``spec_token_ids`` entry.
    ``grammar`` is the sequence's structured-output matcher (None: unconstrained), advanced with every appended
    output token and forked with the sequence (docs/engine.md, "Structured outputs").
    """

    seq_id: int
    request_id: str
    sample_index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    pending_forks: list[Sequence] = field(default_factory=list)
    cache_salt: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_parent_idx: list[int] | None = None
    grammar: StructuredOutputGrammar | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A new sequence with this one's tokens, computed count, cumulative logprob and grammar state (a branch)."""
        child = Sequence(seq_id, self.request_id, sample_index, self.params, self.prompt_token_ids)
        child.token_ids = list(self.token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.num_cached_tokens = self.num_cached_tokens
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        return child

    def append_token(self, token_id: int) -> None:
        """Record one sampled token (its K/V is computed by the next step)."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


@dataclass(slots=True, eq=False)
class Request:
    """One prompt and its sequences; ``prompt_logprobs`` has one entry per prompt token (the first is None).

    ``metrics`` holds the request's stage times; ``arrival_time`` is stamped when the request is built.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    beam_search: BeamSearchState | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


def can_resume(params: SamplingParams) -> bool:
    """Whether a request with ``params`` can resume from its generated token ids alone (docs/engine.md,
    "Resuming a request"): one sequence (greedy, or ``n == best_of == 1``), no beam search, no logprobs
    (a checkpoint keeps no logprobs), no structured outputs (nor any grammar state)."""
    return (
        params.num_branches == 1
        and not params.use_beam_search
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.structured_outputs is None
    )

"""Requests and their sequences: the token streams the scheduler moves between queues (pure Python).

A :class:`Request` is one prompt plus its :class:`~worker.engine.sampling_params.SamplingParams`; it owns
``n`` :class:`Sequence` objects, one per sample. For now the samples share nothing (each prefills the
prompt itself; copy-on-write forks are not built yet, docs/engine.md, "Not built yet"), so the scheduler and the KV cache
manager only ever see sequences. The request finishes when all its sequences do.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.outputs import FinishReason, PositionLogprobs, RequestMetrics
from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.output.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    """Where a sequence is: the waiting queue, the running batch, back in waiting after preemption, or done."""

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
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

"""A small stand-in for `LLMEngine`, and a loop that runs every queued shard through it.

The stand-in honours `LLMEngine`'s contract (add_request / step / abort_request, PromptTooLongError,
one token per running sequence per step, at most ``max_num_seqs`` running; progress and resuming from
``resumed_token_ids`` as `worker.engine.core.request.can_resume` allows), so tests pin the runner's own
behaviour. It is also what tests/e2e/stand_in_worker.py puts in a worker process when a test needs engine
steps of a known length.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.db import session_scope
from jobs.repository import batch_status
from jobs.status import BatchStatus
from worker import runner
from worker.engine.core.request import can_resume
from worker.engine.errors import PromptTooLongError, ResumeError
from worker.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestProgress
from worker.engine.sampling_params import SamplingParams
from worker.engine.stats import EngineStats


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[list[int]] = field(default_factory=list)


class StandInEngine:
    """Emits token ``token_id + sample index`` once per step for each running request until its limit."""

    def __init__(
        self, tokenizer, *, max_model_len: int = 64, max_num_seqs: int = 4, on_step: Callable[[int], None] | None = None
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.on_step = on_step
        self.token_id = tokenizer.encode(" ok")[0]
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.num_steps = 0
        self.num_added = 0
        self.num_added_at_first_step: int | None = None
        self.aborted: list[str] = []
        self.resumed: dict[str, int] = {}
        self.stats = EngineStats()

    def make_stats(self):
        stats, self.stats = self.stats, EngineStats()
        stats.num_running_reqs, stats.num_waiting_reqs = len(self.running), len(self.waiting)
        return stats

    def add_request(self, request_id, prompt, params, *, resumed_token_ids=()):
        assert isinstance(prompt, list), "the runner feeds token ids"
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(len(prompt), self.max_model_len)
        if resumed_token_ids and (params.n > 1 or not can_resume(params)):
            raise ResumeError("cannot resume")
        samples = [list(resumed_token_ids)] + [[] for _ in range(params.n - 1)]
        self.waiting.append(_Request(request_id, prompt, params, samples))
        self.num_added += 1
        self.resumed[request_id] = len(resumed_token_ids)

    def progress(self):
        requests = [*self.waiting, *self.running.values()]
        return {
            r.request_id: RequestProgress(
                sum(map(len, r.samples)), list(r.samples[0]) if can_resume(r.params) and r.params.n == 1 else None
            )
            for r in requests
        }

    def abort_request(self, request_id):
        self.running.pop(request_id, None)
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        if self.num_added_at_first_step is None:
            self.num_added_at_first_step = self.num_added
        if self.on_step is not None:
            self.on_step(self.num_steps)
        self.num_steps += 1
        self.stats.num_steps += 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
        finished = []
        for request in list(self.running.values()):
            room = self.max_model_len - len(request.prompt_token_ids)
            limit = min(request.params.max_tokens or room, room)
            for idx, sample in enumerate(request.samples):
                sample.append(self.token_id + idx)
                self.stats.num_generation_tokens += 1
            if len(request.samples[0]) >= limit:
                del self.running[request.request_id]
                finished.append(self._output(request))
        return finished

    def _output(self, request):
        outputs = []
        for idx, sample in enumerate(request.samples):
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = [{t: Logprob(-0.5, self.tokenizer.decode([t]))} for t in sample]
            outputs.append(
                CompletionOutput(
                    idx, self.tokenizer.decode(sample), list(sample), logprobs=logprobs, finish_reason="length"
                )
            )
        return RequestOutput(
            request.request_id, None, request.prompt_token_ids, outputs, finished=True, num_cached_tokens=0
        )


def run_batch(batch_id: str, **kwargs) -> BatchStatus:
    """Run every queued shard in this process (`runner.run_next_shard` until none is left; ``kwargs``
    go to it); returns ``batch_id``'s status afterwards."""
    while runner.run_next_shard(**kwargs) is not None:
        pass
    with session_scope() as session:
        return batch_status(session, batch_id=batch_id)

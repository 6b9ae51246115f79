"""LLMEngine: continuous batching over a paged KV cache (vLLM's ``LLMEngine`` / ``EngineCore`` loop).

Each :meth:`LLMEngine.step` schedules work (scheduler), runs one forward pass over all scheduled tokens
(model runner), then appends the sampled tokens, detokenizes them, checks stop conditions and frees the
blocks of finished sequences at once, so requests join and leave the batch at every step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as TokenIds

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from worker.engine.config import EngineConfig
from worker.engine.core.beam_search import BeamSearchState, Candidate
from worker.engine.core.kv_cache_manager import KVCacheManager
from worker.engine.core.request import Request, Sequence, SequenceStatus, can_resume
from worker.engine.core.scheduler import Scheduler, SchedulerOutput
from worker.engine.errors import InvalidParameterError, PromptTooLongError, ResumeError
from worker.engine.executor.model_runner import ModelRunner, ModelRunnerOutput
from worker.engine.model_files import load_config, load_tokenizer
from worker.engine.output.detokenizer import IncrementalDetokenizer, decode_token
from worker.engine.output.stop_checker import FinishState, check_finish
from worker.engine.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestProgress,
)
from worker.engine.sample.rejection_sampler import VerifiedTokens
from worker.engine.sampling_params import SamplingParams
from worker.engine.spec_decode.speculator import Speculator, build_speculator
from worker.engine.stats import EngineStats
from worker.engine.structured_output import StructuredOutputManager

_MAX_IDS_SHOWN = 8  # token ids quoted in an error message


def _kv_cache_too_small(config: EngineConfig, num_blocks: int, bytes_per_block: int, max_model_len: int) -> str:
    """Why a KV cache of ``num_blocks`` blocks (``bytes_per_block`` bytes each) cannot hold one sequence of
    ``max_model_len`` tokens, and what makes it fit, by the names a deployment sets (``BATCHINFER_*``, the settings
    of ``jobs.config.Settings``): more bytes, fewer bytes an element (a quantized KV cache, else a bfloat16 one)."""
    needed_blocks = -(-max_model_len // config.block_size)
    context = "" if config.max_model_len else " (the model's max_position_embeddings)"
    problem = (
        f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens, fewer than one sequence of "
        f"max_model_len={max_model_len} tokens{context} needs ({needed_blocks} blocks)"
    )
    if config.num_gpu_blocks_override:
        return f"{problem}; raise num_gpu_blocks_override to at least {needed_blocks}"
    fixes = [
        f"raise kv_cache_memory_bytes (BATCHINFER_KV_CACHE_MEMORY_BYTES, now {config.kv_cache_memory_bytes}) "
        f"to at least {needed_blocks * bytes_per_block}"
    ]
    if config.kv_cache_dtype == "auto":
        fixes.append("set kv_cache_dtype (BATCHINFER_KV_CACHE_DTYPE) to 'int8' or 'fp8_e4m3' (one byte an element)")
        fixes.append("'int4' (half a byte)")
        if config.dtype == "float32":
            fixes.append("run the model in bfloat16 (dtype, BATCHINFER_DTYPE=bfloat16: a bfloat16 KV cache)")
    elif config.kv_cache_dtype != "int4":
        fixes.append("set kv_cache_dtype (BATCHINFER_KV_CACHE_DTYPE) to 'int4' (half a byte an element)")
    return f"{problem}; {', or '.join(fixes)}"


class LLMEngine:
    """Offline engine: add requests, call :meth:`step` until none is unfinished (or use :meth:`generate`).

    Attributes:
        tokenizer: the model folder's Hugging Face tokenizer (as ``AutoTokenizer`` builds it).
        model_config: the model folder's ``transformers`` config values (as ``AutoConfig`` resolves them).
        max_model_len: most tokens (prompt + output) one sequence may hold.

    Raises:
        ValueError: on a ``max_model_len`` beyond the model's positions, or a KV cache too small to hold
            one sequence of ``max_model_len`` tokens (the message names the bytes it needs and the settings that
            make it fit: ``kv_cache_memory_bytes``, a quantized ``kv_cache_dtype``, a bfloat16 ``dtype``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # NOTE: resolved once per model folder and cached beside the prepared weights (worker/engine/model_files.py).
        self.model_config: PretrainedConfig = load_config(config.model, config.prepared_weights_dir)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(config.model, config.prepared_weights_dir)
        max_positions = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {max_positions} positions")
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = self.model_config.eos_token_id
            eos = eos[0] if isinstance(eos, list) else eos
        self.eos_token_id: int | None = eos
        self.model_runner = ModelRunner(config, self.eos_token_id)
        num_blocks = self.model_runner.num_blocks
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                _kv_cache_too_small(config, num_blocks, self.model_runner.bytes_per_block, self.max_model_len)
            )
        model = self.model_runner.model
        # NOTE: only a model whose every layer is windowed frees blocks behind the window (KVCacheManager), and
        # only a window shorter than max_model_len ever leaves a block behind.
        window = model.sliding_window
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.enable_forks,
            sliding_window=window
            if window is not None and model.all_layers_sliding and window < self.max_model_len
            else None,
            long_rope_len=model.long_rope_original_max,
        )
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.speculator: Speculator | None = build_speculator(config, self.model_runner, self.max_model_len)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_id, config.structured_outputs_compile_timeout_s
        )
        self.requests: dict[str, Request] = {}
        self._stats = EngineStats()
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()

    def populate_kv_cache(self) -> None:
        """Fault in every page of the KV cache now instead of in the first jobs' steps: what a long-running
        worker does at start (``worker.bootstrap.warm_up_engine``; docs/engine.md, "KV cache memory")."""
        self.model_runner.populate_kv_cache()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        resumed_token_ids: TokenIds[int] = (),
    ) -> None:
        """Queue a request (tokenizing a text prompt); it joins the batch at a coming step.

        ``params.max_tokens=None``, or more than the room left, means: stop at ``max_model_len`` tokens
        with finish_reason "length".

        ``resumed_token_ids``: tokens an earlier, interrupted run of this same request generated (a
        checkpoint, :meth:`progress`). The request goes on from them as a preempted sequence does: prompt
        plus these tokens are computed in one prefill, and its output holds them followed by the new
        ones. They count as output everywhere (``max_tokens``/``min_tokens``, penalties, the seeded draw's
        position, the detokenizer and stop strings, which replay them), so a greedy or seeded request
        ends as its uninterrupted run would have (docs/engine.md, "Resuming a request").

        Raises:
            PromptTooLongError: ``len(prompt tokens) >= max_model_len`` (no room to generate).
            InvalidParameterError: a token id outside the vocabulary (the prompt's, or in any field
                `SamplingParams.token_id_fields` lists), ``min_tokens`` beyond the room the prompt leaves,
                beam search whose beams cannot fit the KV cache side by side, or a ``structured_outputs``
                constraint that is invalid, unsupported or overran its compile time limit
                (``param="structured_outputs"``; docs/engine.md, "Structured outputs").
            ResumeError: ``resumed_token_ids`` given for parameters that cannot resume (`core.request.can_resume`),
                holding an id outside the vocabulary, or already finishing the request.
            ValueError: a duplicate ``request_id`` or an empty prompt.
        """
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if isinstance(prompt, str):
            text: str | None = prompt
            prompt_token_ids = self.tokenizer.encode(prompt)
        else:
            text, prompt_token_ids = None, list(prompt)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.model_config.vocab_size
        for param, token_ids in {"prompt": prompt_token_ids, **params.token_id_fields()}.items():
            bad_ids = sorted({token_id for token_id in token_ids if not 0 <= token_id < vocab_size})
            if bad_ids:
                shown = ", ".join(map(str, bad_ids[:_MAX_IDS_SHOWN])) + (
                    ", ..." if len(bad_ids) > _MAX_IDS_SHOWN else ""
                )
                raise InvalidParameterError(
                    f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {shown} ({len(bad_ids)} in all)",
                    param,
                )
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
        room = self.max_model_len - len(prompt_token_ids)
        if params.min_tokens > room:
            raise InvalidParameterError(
                f"min_tokens ({params.min_tokens}) cannot be met: the prompt has {len(prompt_token_ids)} tokens "
                f"and the context {self.max_model_len}, which leaves room for {room}",
                "min_tokens",
            )
        if params.use_beam_search:
            # NOTE: a preempted beam group is re-admitted all at once and recomputes without sharing
            # (core/scheduler.py, _admit_beam_group), so its beams must fit the cache side by side.
            max_len = min(self.max_model_len, len(prompt_token_ids) + (params.max_tokens or self.max_model_len))
            num_blocks_needed = params.n * -(-max_len // self.config.block_size)
            if num_blocks_needed > self.model_runner.num_blocks:
                raise InvalidParameterError(
                    f"{params.n} beams of up to {max_len} tokens need {num_blocks_needed} KV blocks; the cache "
                    f"holds {self.model_runner.num_blocks}: lower n or max_tokens",
                    "n",
                )
        if resumed_token_ids and not can_resume(params):
            raise ResumeError(
                "only a request with one sequence, no logprobs, no beam search and no structured outputs can resume"
            )
        if any(not 0 <= token_id < vocab_size for token_id in resumed_token_ids):
            raise ResumeError(f"resumed_token_ids holds token ids outside the vocabulary [0, {vocab_size})")
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.structured_output.compile(params.structured_outputs)
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                sample_index=index,
                params=params,
                prompt_token_ids=prompt_token_ids,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                grammar=None if compiled is None else self.structured_output.new_grammar(compiled),
            )
            for index in range(params.num_branches)
        ]
        if resumed_token_ids:
            self._replay_output(seqs[0], resumed_token_ids)
        request = Request(request_id, text, prompt_token_ids, params, seqs)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        if params.use_beam_search:
            request.beam_search = BeamSearchState(params.n, params.length_penalty, params.early_stopping, [seqs[0]])
        if not self.config.enable_forks:
            # Every branch prefills on its own, and the prefix cache must not share the prompt between them.
            for seq in seqs:
                if seq.sample_index > 0:
                    seq.cache_salt = seq.seq_id
                self.scheduler.add_seq(seq)
            return
        # Only the first branch prefills; the others are forked off it when its prompt is computed.
        seqs[0].pending_forks = seqs[1:]
        for seq in seqs[1:]:
            seq.status = SequenceStatus.FORK_PENDING
        self.scheduler.add_seq(seqs[0])

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.finish_seqs(request.seqs)
        self.model_runner.free_seqs(request.seqs)
        if self.speculator is not None:
            self.speculator.free(request.seqs, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def progress(self) -> dict[str, RequestProgress]:
        """Each unfinished request's progress by request id: the tokens sampled so far and, when it can
        resume (`core.request.can_resume`), its output token ids (resumed ones included), to checkpoint."""
        return {
            request_id: RequestProgress(
                num_generated_tokens=sum(len(seq.output_token_ids) for seq in request.seqs),
                resumable_token_ids=list(request.seqs[0].output_token_ids) if can_resume(request.params) else None,
            )
            for request_id, request in self.requests.items()
        }

    def _replay_output(self, seq: Sequence, token_ids: TokenIds[int]) -> None:
        """Give a fresh ``seq`` the output ``token_ids`` as if it had sampled them (output ids and incremental
        text, so stop strings see the text across the resume point); it then waits like a preempted sequence,
        to compute prompt + output in one prefill.

        Raises:
            ResumeError: one of the tokens finishes the sequence (EOS, a stop id or string, a length limit).
        """
        for token_id in token_ids:
            seq.append_token(token_id)
            finish, _ = self._append_text(seq, token_id)
            if finish is not None:
                raise ResumeError(
                    f"resumed_token_ids finish the request at token {len(seq.output_token_ids)} of "
                    f"{len(token_ids)} ({finish.finish_reason}); nothing is left to resume"
                )

    def _append_text(self, seq: Sequence, token_id: int) -> tuple[FinishState | None, str]:
        """Detokenize ``seq``'s newly appended ``token_id`` and check whether it finishes the sequence (EOS, a
        stop id or string, a length limit); returns that finish (None if it goes on) and the new text."""
        detokenizer = seq.detokenizer
        assert detokenizer is not None
        new_text = detokenizer.append(token_id)
        finish = check_finish(
            params=seq.params,
            last_token_id=token_id,
            num_output_tokens=len(seq.output_token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            output_text=detokenizer.output_text,
            new_char_count=len(new_text),
        )
        return finish, new_text

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, process samples; returns the requests that finished this step."""
        start_s = time.perf_counter()
        speculator = self.speculator
        draft_probs = {}
        if speculator is not None:
            draft_probs = speculator.propose(self.scheduler.running, len(self.scheduler.waiting))
            self._check_drafts(draft_probs)
        scheduler_output = self.scheduler.schedule()
        if speculator is not None and scheduler_output.preempted_seqs:
            speculator.free(scheduler_output.preempted_seqs, finished=False)
        if scheduler_output.is_empty:
            return []
        block_ids = [self.kv_cache_manager.get_block_ids(seq.seq_id) for seq in scheduler_output.seqs]
        self._count_scheduled(scheduler_output, start_s=time.monotonic())
        runner_output = self.model_runner.execute_model(scheduler_output, block_ids, draft_probs)
        sampled_s = time.monotonic()
        if speculator is not None:
            speculator.observe_step(
                scheduler_output.seqs,
                scheduler_output.num_scheduled_tokens,
                runner_output.forward_s + runner_output.sampling_s,
            )
        # Verified tokens are appended before the scheduler marks them computed (it needs their ids).
        finished_seqs = self._process_verified(runner_output.verified_seqs, runner_output.verified, sampled_s)
        self.scheduler.update_from_output(scheduler_output)
        # NOTE: forced tokens join a verified sequence only once the scheduler has rolled back its rejected drafts.
        finished_ids = {id(seq) for seq in finished_seqs}
        finished_seqs += [
            seq
            for seq in runner_output.verified_seqs
            if id(seq) not in finished_ids and self._jump_forward(seq, sampled_s)
        ]
        finished_seqs += self._process_samples(runner_output, sampled_s=sampled_s)
        finished_seqs += self._process_beams(runner_output.beam_seqs, runner_output.beam_candidates)
        self._record_prompt_logprobs(runner_output)
        self.scheduler.finish_seqs(finished_seqs)
        self.model_runner.free_seqs(finished_seqs)
        if speculator is not None:
            speculator.free(finished_seqs, finished=True)

        outputs = []
        for request_id in dict.fromkeys(seq.request_id for seq in finished_seqs):
            request = self.requests[request_id]
            if request.is_finished:
                del self.requests[request_id]
                request.metrics.finished_time = time.monotonic()
                outputs.append(self._request_output(request))

        stats = self._stats
        stats.num_steps += 1
        stats.forward_s += runner_output.forward_s
        stats.sampling_s += runner_output.sampling_s
        stats.grammar_s += runner_output.grammar_s
        occupancy = self.kv_cache_manager.slot_occupancy()
        stats.kv_tokens_stored_sum += occupancy.num_tokens_stored
        stats.kv_slots_sum += occupancy.num_slots
        stats.kv_cache_usage = self.kv_cache_manager.kv_cache_usage
        stats.step_s += time.perf_counter() - start_s
        return outputs

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion with continuous batching; outputs in input order.

        Raises:
            PromptTooLongError, ValueError: as :meth:`add_request` (requests already added are aborted).
            ValueError: ``params`` is a list of a different length than ``prompts``.
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        batch = next(self._generate_ids)
        request_ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, request_params in zip(request_ids, prompts, params_list):
                self.add_request(request_id, prompt, request_params)
        except ValueError:
            for request_id in request_ids:
                self.abort_request(request_id)
            raise
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        while pending:
            for output in self.step():
                if output.request_id in pending:
                    pending.discard(output.request_id)
                    results[output.request_id] = output
        return [results[request_id] for request_id in request_ids]

    def make_stats(self) -> EngineStats:
        """What the engine did since the last call (take and reset: each caller reports a fresh window)."""
        stats, self._stats = self._stats, EngineStats()
        scheduler_stats = self.scheduler.make_stats()
        prefix_cache_stats = self.kv_cache_manager.make_prefix_cache_stats()
        stats.num_preemptions = scheduler_stats.num_preemptions
        stats.num_prefix_holds = scheduler_stats.num_prefix_holds
        stats.num_running_reqs = len(self.scheduler.running)
        stats.num_waiting_reqs = len(self.scheduler.waiting)
        stats.prefix_cache_queries = prefix_cache_stats.queries
        stats.prefix_cache_hits = prefix_cache_stats.hits
        stats.num_kv_blocks_peak = self.kv_cache_manager.block_pool.take_num_used_peak()
        stats.num_kv_blocks = self.model_runner.num_blocks
        stats.kv_cache_bytes = self.model_runner.num_blocks * self.model_runner.bytes_per_block
        compile_stats = self.structured_output.make_stats()
        stats.grammar_compile_times_s = compile_stats.compile_times_s
        stats.grammar_cache_hits = compile_stats.num_cache_hits
        if self.speculator is not None:
            spec_stats = self.speculator.make_stats()
            stats.num_drafts = spec_stats.num_drafts
            stats.num_draft_tokens = spec_stats.num_draft_tokens
            stats.num_accepted_tokens = spec_stats.num_accepted_tokens
            stats.num_accepted_tokens_per_pos = spec_stats.num_accepted_tokens_per_pos
            stats.spec_decode_by_method = spec_stats.by_method
        return stats

    def _check_drafts(self, draft_probs: dict[int, torch.Tensor]) -> None:
        """Cut each constrained sequence's drafts before the first token its grammar does not allow (mutates
        ``spec_token_ids`` and ``draft_probs``): verification then never scores a position the grammar forbids.
        Under jump-forward decoding, drafts also stop before a position where the grammar forces tokens, so the
        tokens are those of the run without speculation. A constrained draft tree keeps its leading chain (the
        grammar's bitmask rows follow one path)."""
        for seq in self.scheduler.running:
            if seq.grammar is None or not seq.spec_token_ids:
                continue
            jump_forward = None
            if self._jumps_forward(seq):
                jump_forward = (self.tokenizer, self.model_config.vocab_size)
            parents, seq.spec_parent_idx = seq.spec_parent_idx, None
            num_chain = len(seq.spec_token_ids)
            if parents is not None:
                num_chain = next((i for i, parent in enumerate(parents) if parent != i - 1), num_chain)
            num_valid = seq.grammar.num_valid_drafts(seq.spec_token_ids[:num_chain], jump_forward)
            if num_valid == len(seq.spec_token_ids):
                continue
            del seq.spec_token_ids[num_valid:]
            probs = draft_probs.pop(seq.seq_id, None)
            if probs is not None and num_valid:
                draft_probs[seq.seq_id] = probs[:num_valid]

    def _count_scheduled(self, scheduler_output: SchedulerOutput, *, start_s: float) -> None:
        """Count the step's tokens; stamp ``first_scheduled_time`` (``start_s``, monotonic) on newly scheduled requests."""
        for seq in scheduler_output.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start_s
        self._stats.num_tokens_per_step.append(scheduler_output.total_num_scheduled_tokens)
        num_decode_tokens = sum(
            1
            for seq, num_tokens in zip(scheduler_output.seqs, scheduler_output.num_scheduled_tokens)
            if num_tokens == 1 + len(seq.spec_token_ids)
            and seq.output_token_ids
            and seq.num_computed_tokens == seq.num_tokens - 1
        )
        self._stats.num_prompt_tokens_computed += scheduler_output.total_num_scheduled_tokens - num_decode_tokens

    def _process_samples(self, runner_output: ModelRunnerOutput, *, sampled_s: float) -> list[Sequence]:
        """Append each sampled token, detokenize, accumulate logprobs, check stops; returns finished sequences.

        Token times (TTFT, inter-token latency) are taken at ``sampled_s`` (monotonic), once per request per step.
        """
        sampler_output = runner_output.sampler_output
        if sampler_output is None:
            return []
        finished = []
        logprobs = sampler_output.logprobs or [0.0] * len(runner_output.sampled_seqs)
        for seq, token_id, logprob, top in zip(
            runner_output.sampled_seqs,
            sampler_output.sampled_token_ids,
            logprobs,
            sampler_output.top_logprobs,
        ):
            if self._append_token(seq, token_id, logprob, top, sampled_s) or self._jump_forward(seq, sampled_s):
                finished.append(seq)
        return finished

    def _jump_forward(self, seq: Sequence, sampled_s: float) -> bool:
        """Append the tokens ``seq``'s grammar forces (jump-forward decoding, docs/engine.md, "Structured
        outputs"): their K/V are computed by the next step in one extend instead of one step each. Only where
        no logprob is needed (a forced token has none without a forward pass). True if ``seq`` finished."""
        grammar = seq.grammar
        if grammar is None or not self._jumps_forward(seq):
            return False
        vocab_size = self.model_config.vocab_size
        while forced := grammar.forced_token_ids(self.tokenizer, vocab_size):
            for token_id in forced:
                self._stats.num_forced_tokens += 1
                if self._append_token(seq, token_id, 0.0, None, sampled_s):
                    return True
        return False

    def _jumps_forward(self, seq: Sequence) -> bool:
        """Whether ``seq`` takes its grammar's forced tokens without a forward pass: jump-forward decoding is on,
        and no logprob (asked for, or ranking ``best_of``) or beam score needs them scored."""
        params = seq.params
        return (
            seq.grammar is not None
            and self.config.enable_jump_forward
            and not params.needs_sampled_logprobs
            and not params.use_beam_search
        )

    def _process_verified(
        self, seqs: list[Sequence], verified: list[VerifiedTokens], sampled_s: float
    ) -> list[Sequence]:
        """Append each sequence's verified tokens one at a time, with every per-token rule (stop strings,
        stop ids, EOS, ``max_tokens``, ``min_tokens``): a sequence that finishes inside its accepted run
        keeps the tokens up to that one only, as the non-speculative run would. Returns finished sequences."""
        finished = []
        speculator = self.speculator
        for seq, result in zip(seqs, verified, strict=True):
            if speculator is not None:
                speculator.record(seq, result.num_draft_tokens, result.num_accepted_tokens)
            logprobs = result.logprobs or [0.0] * len(result.token_ids)
            for token_id, logprob, top in zip(result.token_ids, logprobs, result.top_logprobs, strict=True):
                if self._append_token(seq, token_id, logprob, top, sampled_s):
                    finished.append(seq)
                    break
        return finished

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: float, top: list[tuple[int, float]] | None, sampled_s: float
    ) -> bool:
        """Append one sampled token: token times, logprobs, incremental text, stop checks. True if ``seq``
        finished with it (its finish reason, stop reason and final text are set)."""
        stats = self._stats
        if not seq.output_token_ids:
            stats.num_cached_tokens += seq.num_cached_tokens or 0
        request = self.requests[seq.request_id]
        metrics = request.metrics
        if metrics.last_token_time != sampled_s:
            if metrics.first_token_time is None:
                metrics.first_token_time = sampled_s
                stats.time_to_first_tokens_s.append(sampled_s - metrics.arrival_time)
                stats.num_prompt_tokens += len(request.prompt_token_ids)
            elif metrics.last_token_time is not None:
                stats.inter_token_latencies_s.append(sampled_s - metrics.last_token_time)
            metrics.last_token_time = sampled_s
        seq.append_token(token_id)
        if seq.grammar is not None:
            accepted = seq.grammar.accept_token(token_id)
            assert accepted, "the grammar's bitmask allows only tokens it accepts"
        seq.cumulative_logprob += logprob
        stats.num_generation_tokens += 1
        if seq.logprobs is not None:
            tokenizer = self.tokenizer
            entry: PositionLogprobs = {token_id: Logprob(logprob, decode_token(tokenizer, token_id))}
            for top_id, top_logprob in top or ():
                if top_id not in entry:
                    entry[top_id] = Logprob(top_logprob, decode_token(tokenizer, top_id))
            seq.logprobs.append(entry)
        finish, new_text = self._append_text(seq, token_id)
        detokenizer = seq.detokenizer
        assert detokenizer is not None
        if finish is None and seq.grammar is not None and seq.grammar.is_terminated():
            # NOTE: only the stop token (EOS) terminates a grammar; it ends the output even under ignore_eos or
            # min_tokens, since the grammar allows nothing after it.
            finish = FinishState("stop", None, detokenizer.output_text[: len(detokenizer.output_text) - len(new_text)])
        if finish is None:
            return False
        seq.finish_reason, seq.stop_reason, seq.output_text = (
            finish.finish_reason,
            finish.stop_reason,
            finish.output_text,
        )
        if finish.finish_reason == "length":
            # NOTE: text held back for an incomplete character is emitted (as U+FFFD) at the end.
            seq.output_text += detokenizer.flush()
        return True

    def _process_beams(self, beam_seqs: list[Sequence], beam_candidates: list[list[Candidate]]) -> list[Sequence]:
        """Report each beam's candidates; run the beam step of every request whose live beams all reported
        (core/beam_search.py): extend kept beams, fork extra ones, drop the rest. Returns dropped beams."""
        ready = []
        for seq, candidates in zip(beam_seqs, beam_candidates, strict=True):
            state = self.requests[seq.request_id].beam_search
            assert state is not None
            if state.report(seq, candidates):
                ready.append(self.requests[seq.request_id])
        dropped_seqs: list[Sequence] = []
        for request in dict.fromkeys(ready):
            state = request.beam_search
            assert state is not None
            stops = {
                (beam.seq_id, token_id): stop
                for beam in state.live
                for token_id, _ in state.candidates[beam.seq_id]
                if (stop := self._beam_stop(beam, token_id)) is not None
            }
            beam_step = state.step(stops)
            # Forks first, while every parent still ends where its candidates were computed.
            new_live: list[tuple[Sequence, int, float]] = []
            continued: set[int] = set()
            for parent, token_id, logprob in beam_step.kept:
                beam = parent
                if id(parent) in continued:
                    beam = parent.fork(next(self._seq_ids), len(request.seqs))
                    if not self.config.enable_forks:
                        beam.cache_salt = beam.seq_id
                    self.scheduler.fork_seq(parent, beam)
                    request.seqs.append(beam)
                continued.add(id(parent))
                new_live.append((beam, token_id, logprob))
            for beam, token_id, logprob in new_live:
                beam.append_token(token_id)
                if beam.grammar is not None:
                    accepted = beam.grammar.accept_token(token_id)
                    assert accepted, "a constrained beam's candidates are tokens its grammar allows"
                beam.cumulative_logprob += logprob
            self._stats.num_generation_tokens += len(new_live)
            state.live = [beam for beam, _, _ in new_live]
            dropped_seqs += beam_step.dropped
        return dropped_seqs

    def _beam_stop(self, beam: Sequence, token_id: int) -> tuple[FinishReason, int | None] | None:
        """Whether appending ``token_id`` ends ``beam``: ``("stop", stop token id, None for EOS)``,
        ``("length", None)``, or None while it goes on."""
        params = beam.params
        if token_id == self.eos_token_id and (not params.ignore_eos or beam.grammar is not None):
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
        num_output_tokens = len(beam.output_token_ids) + 1
        if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or (
            beam.num_prompt_tokens + num_output_tokens >= self.max_model_len
        ):
            return "length", None
        return None

    def _record_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        """Append prompt logprobs computed this step (skipping positions recomputed after a preemption)."""
        tokenizer = self.tokenizer
        for chunk in runner_output.prompt_logprobs:
            request = self.requests[chunk.seq.request_id]
            recorded = request.prompt_logprobs
            assert recorded is not None
            prompt_token_ids = request.prompt_token_ids
            for position, (logprob, top) in enumerate(chunk.entries, start=chunk.first_position):
                if position != len(recorded):
                    continue
                target_id = prompt_token_ids[position]
                entry: PositionLogprobs = {target_id: Logprob(logprob, decode_token(tokenizer, target_id))}
                for top_id, top_logprob in top:
                    if top_id not in entry:
                        entry[top_id] = Logprob(top_logprob, decode_token(tokenizer, top_id))
                recorded.append(entry)

    def _request_output(self, request: Request) -> RequestOutput:
        """The request's ``n`` choices, index order: the branches themselves; the ``n`` of ``best_of`` with the
        highest cumulative logprob (ties: lower sample index); or greedy's one branch ``n`` times."""
        params = request.params
        if request.beam_search is not None:
            return self._beam_request_output(request, request.beam_search)
        if len(request.seqs) == 1:
            chosen = request.seqs * params.n
        elif len(request.seqs) == params.n:
            chosen = request.seqs
        else:
            chosen = sorted(request.seqs, key=lambda seq: (-seq.cumulative_logprob, seq.sample_index))[: params.n]
        outputs = [
            CompletionOutput(
                index=index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=None if params.logprobs is None else seq.cumulative_logprob,
                logprobs=None if seq.logprobs is None else list(seq.logprobs),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for index, seq in enumerate(chosen)
        ]
        return self._finished_output(request, outputs)

    @staticmethod
    def _finished_output(request: Request, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=True,
            prompt_logprobs=request.prompt_logprobs,
            # NOTE: a resumed request's first lookup also covered its resumed output; usage counts prompt hits only.
            num_cached_tokens=min(request.seqs[0].num_cached_tokens or 0, len(request.prompt_token_ids)),
            metrics=request.metrics,
        )

    def _beam_request_output(self, request: Request, state: BeamSearchState) -> RequestOutput:
        """The ``n`` best finished beams, best first; text decoded without a final stop token."""
        params = request.params
        outputs = []
        for index, hyp in enumerate(state.best(params.n)):
            text_ids = hyp.token_ids
            if hyp.finish_reason == "stop" and not params.include_stop_str_in_output:
                text_ids = text_ids[:-1]
            text = self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
            assert isinstance(text, str)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(hyp.token_ids),
                    cumulative_logprob=None if params.logprobs is None else hyp.cumulative_logprob,
                    finish_reason=hyp.finish_reason,
                    stop_reason=hyp.stop_reason,
                )
            )
        return self._finished_output(request, outputs)

"""Engine statistics under vLLM's names, taken and reset by whoever reports them (benchmarks, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    """What the engine did since the last :meth:`~worker.engine.llm_engine.LLMEngine.make_stats` (times in seconds).

    Attributes:
        num_steps: engine steps run.
        num_prompt_tokens_computed: tokens run through the model that were not a sequence's one decode
            token (prefill chunks, recomputation after preemption; prefix-cache hits excluded).
        num_generation_tokens: tokens sampled (vLLM's ``generation_tokens``).
        num_prompt_tokens: prompt length of each request that sampled its first token (vLLM's
            ``prompt_tokens``: counted once per request, prefix-cache hits included).
        num_cached_tokens: prompt tokens served by the prefix cache, counted once per sequence.
        num_preemptions, num_prefix_holds: the scheduler's counters (``SchedulerStats``).
        prefix_cache_queries, prefix_cache_hits: vLLM's prefix-cache counters in tokens (``PrefixCacheStats``).
        kv_cache_usage: fraction of KV blocks in use after the last step (vLLM's ``kv_cache_usage``).
        num_kv_blocks, kv_cache_bytes: the KV cache's size, in blocks and in bytes (all layers, K and V,
            scales of a quantized cache included): ``kv_cache_usage`` is a fraction of these.
        num_kv_blocks_peak: most KV blocks referenced at once at any moment of the window (within steps too,
            before finished sequences free theirs).
        num_running_reqs, num_waiting_reqs: sequences in the running batch and in the waiting queue
            when the stats were taken (vLLM V1 counts each of ``n`` samples as a request too).
        num_tokens_per_step: tokens scheduled in each step (vLLM's ``iteration_tokens_total`` observations).
        time_to_first_tokens_s: arrival to the end of the step that sampled the first token, per request.
        inter_token_latencies_s: between a request's consecutive token-sampling steps (vLLM's
            ``inter_token_latency``), one per request per step after its first token.
        kv_tokens_stored_sum, kv_slots_sum: per step, the computed tokens held in referenced blocks and
            those blocks' slots, summed over steps (their ratio is :attr:`kv_slot_utilization`).
        forward_s: model forward and logits; sampling_s: the sampler and prompt logprobs;
            grammar_s: filling structured-output token bitmasks; step_s: whole steps (scheduling and output
            processing included).
        grammar_compile_times_s: seconds of each grammar compile (a cache miss) in the window;
            grammar_cache_hits: constraints found compiled; num_forced_tokens: output tokens a grammar
            forced (jump-forward decoding) rather than the model sampled (docs/engine.md, "Structured outputs").
        num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos: vLLM's
            spec-decoding counters: sequence-steps that verified drafts, drafts verified, drafts accepted,
            and per draft position ``j`` the drafts accepted there (docs/engine.md, "Speculative decoding").
        spec_decode_by_method: the first three per drafting method (``"ngram"``, ``"eagle"``, ...):
            ``[num_drafts, num_draft_tokens, num_accepted_tokens]``.
    """

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_holds: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    kv_cache_bytes: int = 0
    num_kv_blocks_peak: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens_per_step: list[int] = field(default_factory=list)
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    kv_tokens_stored_sum: int = 0
    kv_slots_sum: int = 0
    forward_s: float = 0.0
    sampling_s: float = 0.0
    grammar_s: float = 0.0
    step_s: float = 0.0
    grammar_compile_times_s: list[float] = field(default_factory=list)
    grammar_cache_hits: int = 0
    num_forced_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_decode_by_method: dict[str, list[int]] = field(default_factory=dict)

    @property
    def kv_slot_utilization(self) -> float:
        """Tokens stored / slots of referenced blocks, both summed over steps (each step weighs by its KV use);
        1 minus the internal fragmentation of last blocks (Kwon et al. 2023, section 6)."""
        return self.kv_tokens_stored_sum / self.kv_slots_sum if self.kv_slots_sum else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` in [0, 1] (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's mean acceptance length: tokens per verification step, ``1 + num_accepted_tokens / num_drafts``
        (the accepted drafts plus the token the target adds); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """``num_accepted_tokens / num_draft_tokens`` in [0, 1] (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

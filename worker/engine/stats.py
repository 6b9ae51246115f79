"""Engine statistics under vLLM's names, taken and reset by whoever reports them (benchmarks, metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    """What the engine did since the last :meth:`~worker.engine.llm_engine.LLMEngine.make_stats` (times in seconds).

    Attributes:
        num_steps: engine steps run.
        num_prompt_tokens_computed: tokens run through the model that were not a sequence's one decode
            token (prefill chunks, recomputation after preemption; prefix-cache hits excluded).
        num_generation_tokens: tokens sampled (vLLM's ``generation_tokens``).
        num_cached_tokens: prompt tokens served by the prefix cache, counted once per sequence.
        num_preemptions, num_prefix_holds: the scheduler's counters (``SchedulerStats``).
        prefix_cache_queries, prefix_cache_hits: vLLM's prefix-cache counters in tokens (``PrefixCacheStats``).
        kv_cache_usage: fraction of KV blocks in use after the last step (vLLM's ``kv_cache_usage``).
        kv_tokens_stored_sum, kv_slots_sum: per step, the computed tokens held in referenced blocks and
            those blocks' slots, summed over steps (their ratio is :attr:`kv_slot_utilization`).
        forward_s: model forward and logits; sampling_s: the sampler and prompt logprobs;
            step_s: whole steps (scheduling and output processing included).
    """

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_holds: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_usage: float = 0.0
    kv_tokens_stored_sum: int = 0
    kv_slots_sum: int = 0
    forward_s: float = 0.0
    sampling_s: float = 0.0
    step_s: float = 0.0

    @property
    def kv_slot_utilization(self) -> float:
        """Tokens stored / slots of referenced blocks, both summed over steps (each step weighs by its KV use);
        1 minus the internal fragmentation of last blocks (Kwon et al. 2023, section 6)."""
        return self.kv_tokens_stored_sum / self.kv_slots_sum if self.kv_slots_sum else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prefix_cache_queries`` in [0, 1] (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

"""What the sampler reads and returns for one step (row ``i`` is row ``i`` of the step's logits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling inputs for one step (row ``i`` describes row ``i`` of the logits).

    ``sampling_keys[i]`` keys row ``i``'s random numbers (see ``sampler.make_sampling_key``; greedy rows
    ignore it); the counter of its draw is ``len(output_token_ids[i])``, the index of the token being
    sampled. ``prompt_token_ids``/``output_token_ids`` feed the penalties
    (repetition counts prompt + output tokens, as vLLM; presence/frequency count output tokens only) and
    min-tokens masking; ``eos_token_id`` is masked together with ``params.stop_token_ids`` while
    ``len(output_token_ids[i]) < params.min_tokens``, unless ``params.ignore_eos`` or the row is constrained.
    ``constrained_rows`` are the rows under a structured-output grammar; ``token_bitmask`` (int32
    ``[num_rows, ceil(vocab_size / 32)]``, row ``i`` for logits row ``i``) holds their allowed tokens, and every
    other token of those rows is excluded from sampling (docs/engine.md, "Structured outputs").
    """

    params: list[SamplingParams]
    sampling_keys: list[int]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_id: int | None
    token_bitmask: torch.Tensor | None = None
    constrained_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, its raw logprob, and the requested top alternatives.

    ``logprobs`` is ``None`` when no row of the step needs them (see
    ``SamplingParams.needs_sampled_logprobs``; the vocabulary-wide log-sum-exp is then skipped).
    ``top_logprobs[i]`` holds ``params.logprobs`` pairs ``(token_id, raw logprob)`` in descending order
    (an empty list for ``logprobs=0``), or ``None`` when the row asked for no logprobs.
    """

    sampled_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]] | None]

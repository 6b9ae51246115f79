"""Per-request sampling parameters (vLLM's `SamplingParams` vocabulary, OpenAI field semantics)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's generated text (vLLM's `StructuredOutputsParams`): exactly one field set.

    ``json``: a JSON Schema (as a dict or its JSON text) the output must validate against; ``regex``: a
    pattern the whole output must match; ``choice``: the output is exactly one of these strings;
    ``grammar``: an EBNF/GBNF grammar (root rule ``root``) the output must derive; ``json_object``: any
    JSON object. Built by the request mapping from OpenAI's ``response_format`` / ``text.format`` and
    vLLM's ``structured_outputs`` body field (docs/api.md, "Structured outputs").

    Raises:
        ValueError: when not exactly one constraint is set, or ``choice`` is empty.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"exactly one structured output constraint must be set, got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("choice must hold at least one string")


@dataclass(slots=True)
class SamplingParams:
    """How to decode one request.

    Semantics follow vLLM: ``temperature == 0`` is greedy and neutralises ``top_p``/``top_k``/``min_p``;
    ``top_k <= 0`` disables top-k; ``max_tokens`` counts generated tokens (>= 1; ``None`` = up to the
    context limit); ``logprobs`` is the number of top alternatives returned per generated token
    (``0`` = only the sampled token's logprob, ``None`` = no logprobs); ``prompt_logprobs`` likewise
    for prompt positions (used by completions ``echo`` + ``logprobs``). ``seed`` keys a per-sequence
    random stream derived from ``(seed, prompt token ids, sample index)``, never from batch position, and
    makes the request batch invariant (:attr:`batch_invariant`).

    ``n`` samples are returned; ``best_of`` (>= ``n``, default ``n``) branches are sampled and the ``n``
    with the highest cumulative raw logprob are returned (OpenAI completions' ``best_of``). All branches
    share the prompt's KV blocks (one prefill, copy-on-write forks). Greedy decoding computes one branch
    and returns it ``n`` times.

    Raises:
        ValueError: on out-of-range values (the message names the field).
    """

    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.use_beam_search and self.best_of not in (None, self.n):
            raise ValueError(f"best_of must equal n ({self.n}) with beam search, got {self.best_of}")
        if self.use_beam_search and self.stop:
            raise ValueError("stop strings are not supported with beam search (use stop_token_ids)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    def token_id_fields(self) -> dict[str, Collection[int]]:
        """The token ids each field holds, by field name: every one must be in the model's vocabulary.

        A new field holding token ids must be listed here, so the engine checks it with the others.
        """
        return {"logit_bias": (self.logit_bias or {}).keys(), "stop_token_ids": self.stop_token_ids}

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def batch_invariant(self) -> bool:
        """Whether the request's numbers must not depend on its batch: seeded requests, whose tokens must
        reproduce whatever shares their steps, however their prefill is chunked and after preemption
        (docs/engine.md, "Batch-invariant numerics")."""
        return self.seed is not None

    @property
    def num_branches(self) -> int:
        """Sequences the engine starts for one request: 1 when greedy or beam search (beams fork as they
        go), else ``best_of`` (or ``n``)."""
        return 1 if self.is_greedy or self.use_beam_search else (self.best_of or self.n)

    @property
    def needs_sampled_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs are needed: asked for, or to rank ``best_of`` branches."""
        return self.logprobs is not None or (not self.use_beam_search and self.num_branches > self.n)

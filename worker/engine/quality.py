"""How closely an approximate engine (quantized weights, a quantized KV cache) follows a reference one.

Two measures, both from prompt logprobs in one prefill per line, so no sampling noise enters:

- **Teacher-forced top-1 agreement.** The reference's greedy continuation is appended to each prompt and
  scored by the engine under test: at each continuation position, does the engine's most likely token equal
  the one the reference chose? A disagreement also records its gap (the engine's logprob of its own top token
  minus that of the reference's token), so a near-tie can be told from a real change. This is the quality
  bound the quantization issues set (docs/engine.md, "Quantized weights" and "Quantized KV cache").
- **Perplexity** of a fixed text: ``exp`` of the mean negative logprob of each token after the first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams


class ScoringEngine(Protocol):
    """The slice of `worker.engine.llm_engine.LLMEngine` these measures use."""

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]: ...


@dataclass(frozen=True, slots=True)
class Disagreement:
    """A forced position where the engine's top token is not the reference's: ``line`` and ``position``
    (0-based, in the continuation), both tokens, and ``gap_nats`` (None when the reference's token is not
    among the logprobs returned)."""

    line: int
    position: int
    reference_token: int
    engine_token: int
    gap_nats: float | None


@dataclass(slots=True)
class Agreement:
    """``num_agree`` of ``num_positions`` forced positions agree; ``disagreements`` lists the others."""

    num_agree: int = 0
    num_positions: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """``num_agree / num_positions`` (1.0 with no positions)."""
        return self.num_agree / self.num_positions if self.num_positions else 1.0


def teacher_forced_agreement(
    engine: ScoringEngine,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    num_logprobs: int = 2,
) -> Agreement:
    """Score ``prompts[i] + continuations[i]`` with ``engine`` and compare its top-1 token at each
    continuation position with the continuation's (see the module docstring).

    Args:
        prompts, continuations: token ids, one pair per line (the reference's greedy continuation).
        num_logprobs: prompt logprobs asked per position (2 lets most disagreements report their gap).
    """
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=num_logprobs)
    outputs = engine.generate([list(p) + list(c) for p, c in zip(prompts, continuations, strict=True)], scoring)
    result = Agreement()
    for line, (prompt, continuation, output) in enumerate(zip(prompts, continuations, outputs, strict=True)):
        assert output.prompt_logprobs is not None
        for position, token in enumerate(continuation):
            logprobs = output.prompt_logprobs[len(prompt) + position]
            assert logprobs is not None
            top = max(logprobs, key=lambda token_id: logprobs[token_id].logprob)
            result.num_positions += 1
            if top == token:
                result.num_agree += 1
                continue
            gap = logprobs[top].logprob - logprobs[token].logprob if token in logprobs else None
            result.disagreements.append(Disagreement(line, position, token, top, gap))
    return result


def perplexity(engine: ScoringEngine, texts: Sequence[Sequence[int]]) -> float:
    """``exp(-mean logprob)`` of every token of ``texts`` (token ids) after each text's first, under ``engine``."""
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    logprobs = []
    for ids, output in zip(texts, engine.generate([list(t) for t in texts], scoring), strict=True):
        assert output.prompt_logprobs is not None
        for i in range(1, len(ids)):
            position = output.prompt_logprobs[i]
            assert position is not None
            logprobs.append(position[ids[i]].logprob)
    return math.exp(-sum(logprobs) / len(logprobs))

"""Teacher-forced agreement and perplexity (worker/engine/quality.py) on a scripted engine whose scores are known."""

from __future__ import annotations

import math

import pytest

from worker.engine.outputs import Logprob, RequestOutput
from worker.engine.quality import Disagreement, perplexity, teacher_forced_agreement
from worker.engine.sampling_params import SamplingParams


class ScriptedEngine:
    """Scores every position with ``{token: logprob}`` from ``scores`` (by absolute position), whatever the input."""

    def __init__(self, scores: dict[int, dict[int, float]]) -> None:
        self.scores = scores

    def generate(self, prompts, params: SamplingParams) -> list[RequestOutput]:
        assert params.prompt_logprobs is not None and params.max_tokens == 1
        return [
            RequestOutput(
                request_id=str(i),
                prompt=None,
                prompt_token_ids=list(ids),
                outputs=[],
                finished=True,
                prompt_logprobs=[None]
                + [
                    {
                        t: Logprob(logprob=lp, decoded_token="")
                        for t, lp in self.scores.get(pos, {ids[pos]: 0.0}).items()
                    }
                    for pos in range(1, len(ids))
                ],
            )
            for i, ids in enumerate(prompts)
        ]


def test_agreement_counts_forced_positions_and_reports_each_disagreement_with_its_gap() -> None:
    # prompt [1, 2] + continuation [3, 4, 5]: positions 2, 3, 4 are scored.
    engine = ScriptedEngine({2: {3: -0.1, 9: -2.0}, 3: {7: -0.5, 4: -0.55}, 4: {8: -0.1, 6: -3.0}})
    agreement = teacher_forced_agreement(engine, [[1, 2]], [[3, 4, 5]])
    assert (agreement.num_agree, agreement.num_positions) == (1, 3)
    assert agreement.fraction == pytest.approx(1 / 3)
    assert agreement.disagreements[0] == Disagreement(0, 1, 4, 7, pytest.approx(0.05))
    assert agreement.disagreements[1] == Disagreement(0, 2, 5, 8, None)  # the reference's token was not returned


def test_perplexity_is_exp_of_the_mean_negative_logprob_after_the_first_token() -> None:
    engine = ScriptedEngine({1: {5: math.log(0.5)}, 2: {6: math.log(0.25)}})
    assert perplexity(engine, [[4, 5, 6]]) == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.25)) / 2))

"""The automatic speculation policy: the measured step-cost model and the choice of k (docs/engine.md,
"Speculative decoding", Policy)."""

import pytest

from worker.engine.spec_decode.policy import PRIOR_TOKEN_COST, SpecDecodePolicy, StepCostModel


def _observe_line(model: StepCostModel, fixed_s: float, per_token_s: float, sizes: list[int]) -> None:
    for num_tokens in sizes:
        model.observe(num_tokens, fixed_s + per_token_s * num_tokens)


def test_step_cost_model_recovers_the_line_of_its_steps():
    model = StepCostModel()
    _observe_line(model, 0.020, 0.001, [1, 13, 64, 8, 1, 32] * 10)
    assert model.token_cost_ratio() == pytest.approx(0.05, rel=1e-6)
    # B t / (w + B t): small at batch 1, most of the step at batch 64
    assert model.row_share(1) == pytest.approx(0.05 / 1.05)
    assert model.row_share(64) == pytest.approx(3.2 / 4.2)


@pytest.mark.parametrize(
    "steps",
    [
        [],  # nothing measured
        [(1, 0.03)] * 20,  # every step the same size: no slope to fit
        [(1, 0.03), (13, 0.02)] * 10,  # bigger steps faster (noise): not a cost model
    ],
)
def test_step_cost_model_falls_back_to_the_prior(steps):
    model = StepCostModel()
    for num_tokens, seconds in steps:
        model.observe(num_tokens, seconds)
    assert model.token_cost_ratio() == PRIOR_TOKEN_COST


def test_step_cost_model_follows_the_recent_steps():
    model = StepCostModel()
    _observe_line(model, 0.020, 0.004, [1, 9] * 50)  # a slow phase (t / w = 0.2), then a fast one
    _observe_line(model, 0.020, 0.001, [1, 9] * 200)
    assert model.token_cost_ratio() == pytest.approx(0.05, rel=1e-3)


def _policy(*, force: bool = False, max_spec_tokens: int = 12) -> SpecDecodePolicy:
    policy = SpecDecodePolicy(
        force=force, max_spec_tokens=max_spec_tokens, disable_by_batch_size=16, proposer_cost_per_token=0.0
    )
    _observe_line(policy.step_cost, 0.025, 0.001, [1, 5, 16, 64] * 10)  # t / w = 0.04
    return policy


def _with_acceptance(policy: SpecDecodePolicy, seq_id: int, accepted: int, drafted: int, times: int) -> None:
    for _ in range(times):
        policy.record(seq_id, drafted, accepted)


def test_k_shrinks_as_the_batch_grows():
    policy = _policy()
    ks = []
    for num_running in (1, 4, 16, 256):
        _with_acceptance(policy, seq_id=num_running, accepted=3, drafted=4, times=5)  # alpha about 0.8
        ks.append(policy.num_spec_tokens(num_running, num_running))
    assert ks[0] >= 4
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[2]
    assert ks[3] == 0  # a 256-row step: one more position costs more (0.91 of a row) than it yields (0.8)


def test_low_acceptance_decodes_plainly_unless_forced():
    for force, expected in ((False, 0), (True, 1)):
        policy = _policy(force=force)
        _with_acceptance(policy, seq_id=7, accepted=0, drafted=4, times=10)
        assert policy.num_spec_tokens(7, 4) == expected


def test_batch_gate():
    policy = _policy()
    assert policy.batch_speculates(16) and not policy.batch_speculates(17)
    assert _policy(force=True).batch_speculates(1000)

"""Who speculates in a step: the job's tail rule of ``Speculator.propose`` (docs/engine.md, "Speculative decoding")."""

from worker.engine.core.request import Sequence, SequenceStatus
from worker.engine.sampling_params import SamplingParams
from worker.engine.spec_decode.ngram_proposer import NgramProposer
from worker.engine.spec_decode.policy import SpecDecodePolicy
from worker.engine.spec_decode.proposer import DraftProposal, Proposer
from worker.engine.spec_decode.speculator import Speculator

REPEATING = [5, 6, 7, 8] * 6  # n-gram lookup always has a continuation


def _decoding(seq_id: int, max_tokens: int, num_output: int = 4) -> Sequence:
    """A running greedy sequence about to decode its next token, ``num_output`` tokens generated."""
    seq = Sequence(seq_id, f"r{seq_id}", 0, SamplingParams(temperature=0.0, max_tokens=max_tokens), REPEATING)
    for token in REPEATING[:num_output]:
        seq.append_token(token)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def _speculator(*, force: bool = False) -> Speculator:
    policy = SpecDecodePolicy(force=force, max_spec_tokens=4, disable_by_batch_size=16, proposer_cost_per_token=0.0)
    return Speculator(NgramProposer(1, 8), policy, force=force, max_model_len=4096)


def test_with_nothing_waiting_only_the_sequences_that_may_finish_last_speculate():
    running = [_decoding(0, max_tokens=64), _decoding(1, max_tokens=32), _decoding(2, max_tokens=64)]
    _speculator().propose(running, num_waiting=0)
    assert [bool(seq.spec_token_ids) for seq in running] == [True, False, True]


def test_while_requests_wait_every_eligible_sequence_may_speculate():
    running = [_decoding(0, max_tokens=64), _decoding(1, max_tokens=32)]
    _speculator().propose(running, num_waiting=3)
    assert all(seq.spec_token_ids for seq in running)


def test_a_longest_sequence_that_cannot_speculate_stops_the_rest():
    beam = Sequence(9, "beam", 0, SamplingParams(n=2, use_beam_search=True, max_tokens=128), REPEATING)
    beam.append_token(5)
    beam.num_computed_tokens = beam.num_tokens - 1
    beam.status = SequenceStatus.RUNNING
    running = [_decoding(0, max_tokens=64), beam]
    assert _speculator().propose(running, num_waiting=0) == {}
    assert not running[0].spec_token_ids


def test_forced_speculation_ignores_the_tail_rule():
    running = [_decoding(0, max_tokens=64), _decoding(1, max_tokens=32)]
    _speculator(force=True).propose(running, num_waiting=0)
    assert all(seq.spec_token_ids for seq in running)


class _Fixed(Proposer):
    """Proposes ``token`` repeated ``k`` times."""

    def __init__(self, token: int, cost_per_token: float) -> None:
        self.token = token
        self.cost_per_token = cost_per_token
        self.method = f"fixed{token}"

    def propose(self, seqs, num_spec_tokens):
        return [DraftProposal([self.token] * k) for k in num_spec_tokens]


def _policy(cost: float) -> SpecDecodePolicy:
    return SpecDecodePolicy(force=False, max_spec_tokens=4, disable_by_batch_size=16, proposer_cost_per_token=cost)


def test_auto_method_takes_the_drafter_with_the_best_measured_rate_per_sequence():
    """Two sequences: the first accepts everything drafter A proposes and nothing of B's, the second the reverse;
    after a few recorded steps each sequence drafts long runs with its own better drafter."""
    primary, other = _policy(0.05), _policy(0.05)
    other.step_cost = primary.step_cost
    a, b = _Fixed(11, 0.05), _Fixed(22, 0.05)
    speculator = Speculator(a, primary, force=False, max_model_len=4096, alternatives=[(b, other)])
    running = [_decoding(0, max_tokens=64), _decoding(1, max_tokens=64)]
    good = {0: 11, 1: 22}
    for _ in range(12):
        for seq in running:
            seq.spec_token_ids = []
        speculator.propose(running, num_waiting=3)
        for seq in running:
            drafts = seq.spec_token_ids
            accepted = len(drafts) if drafts and drafts[0] == good[seq.seq_id] else 0
            if drafts:
                speculator.record(seq, len(drafts), accepted)
    for seq in running:
        seq.spec_token_ids = []
    speculator.propose(running, num_waiting=3)
    assert running[0].spec_token_ids[0] == 11 and running[1].spec_token_ids[0] == 22
    assert len(running[0].spec_token_ids) > 1 and len(running[1].spec_token_ids) > 1
    by_method = speculator.make_stats().by_method
    assert set(by_method) == {"fixed11", "fixed22"}
    assert all(0 < accepted <= draft_tokens for _, draft_tokens, accepted in by_method.values())

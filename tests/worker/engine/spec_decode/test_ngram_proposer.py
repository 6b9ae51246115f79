"""N-gram prompt lookup (docs/engine.md, "Speculative decoding")."""

import pytest

from worker.engine.core.request import Sequence
from worker.engine.sampling_params import SamplingParams
from worker.engine.spec_decode.ngram_proposer import NgramProposer


def _seq(token_ids: list[int]) -> Sequence:
    return Sequence(0, "r0", 0, SamplingParams(temperature=0.0), token_ids)


def test_longest_suffix_match_proposes_what_followed_its_latest_occurrence():
    proposer = NgramProposer(1, 4)
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 7, 2, 3, 4]
    # suffix (2, 3, 4) (n=3 since (7,2,3,4) never occurred before) last ended at index 8 -> 8, 7, ...
    assert proposer.propose_tokens(0, tokens, 3) == [8, 7, 2]


def test_longer_ngrams_win_over_shorter_ones():
    proposer = NgramProposer(1, 4)
    tokens = [5, 6, 7, 1, 9, 9, 6, 7, 2, 5, 6, 7]
    # (6, 7) last occurred at 6..7 -> 2, but (5, 6, 7) occurred at 0..2 -> 1
    assert proposer.propose_tokens(0, tokens, 2) == [1, 9]


def test_continuation_copies_its_own_proposal_through_the_end():
    proposer = NgramProposer(1, 4)
    word = [11, 12]
    tokens = word * 5
    assert proposer.propose_tokens(0, tokens, 5) == [11, 12, 11, 12, 11]
    assert proposer.propose_tokens(1, [7] * 6, 4) == [7, 7, 7, 7]


def test_no_match_no_draft_and_min_n_respected():
    assert NgramProposer(1, 4).propose_tokens(0, [1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 4).propose_tokens(0, [1, 2, 3, 1], 3) == []
    assert NgramProposer(1, 4).propose_tokens(0, [1, 2, 3, 1], 3) == [2, 3, 1]


def test_index_grows_incrementally_and_matches_a_fresh_one():
    incremental = NgramProposer(1, 3)
    tokens: list[int] = []
    stream = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    for token in stream:
        tokens.append(token)
        got = incremental.propose_tokens(0, tokens, 4)
        assert got == NgramProposer(1, 3).propose_tokens(1, list(tokens), 4)


def test_bad_bounds_refused():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)


def test_tree_width_proposes_distinct_continuations_latest_first():
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2, 8, 9, 1, 2]
    # "1 2" was followed by 3 (latest at 10), 5, 8 (latest); width 3 keeps 8, 3 and 5, latest first.
    assert NgramProposer(1, 4, tree_width=3).propose_branches(0, tokens, 2) == [[8, 9], [3, 7], [5, 6]]
    assert NgramProposer(1, 4, tree_width=2).propose_branches(0, tokens, 3) == [[8, 9, 1], [3, 7, 1]]
    assert NgramProposer(1, 4).propose_branches(0, tokens, 2) == [[8, 9]]  # width 1: today's chain
    proposal = NgramProposer(1, 4, tree_width=3).propose([_seq(tokens)], [2])[0]
    assert proposal.token_ids == [8, 9, 3, 7, 5, 6]
    assert proposal.parent_idx == [-1, 0, -1, 2, -1, 4]


def test_tree_branches_grow_incrementally_like_a_fresh_index():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    proposer = NgramProposer(1, 4, tree_width=3)
    assert proposer.propose_branches(0, tokens, 2) == [[4, 1], [3, 1]]
    tokens += [3, 5, 1, 2]
    assert proposer.propose_branches(0, tokens, 2) == NgramProposer(1, 4, tree_width=3).propose_branches(1, tokens, 2)

"""The rejection sampler (Leviathan et al. 2023) on synthetic distributions: the first output token and
the pair of the first two are distributed as the target's, for model drafts (any ``q``) and one-hot drafts."""

import pytest
import torch

from tests.worker.engine.spec_decode.stats_helpers import chi_square_p_value
from worker.engine.sample import rejection_sampler
from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sample.rejection_sampler import RejectionSampler
from worker.engine.sample.sampler import Sampler, make_sampling_key
from worker.engine.sampling_params import SamplingParams

VOCAB = 6
P_MIN = 1e-3  # flake rate of each distribution check


def _metadata(params, num_rows, key):
    return SamplingMetadata([params] * num_rows, [key] * num_rows, [[0]] * num_rows, [[]] * num_rows, None)


def _target_logits(num_drafts):
    torch.manual_seed(0)
    return torch.randn(num_drafts + 1, VOCAB) * 1.5


def test_greedy_accepts_while_argmax_agrees_and_adds_the_target_token():
    logits = _target_logits(3)
    argmax = logits.argmax(dim=-1).tolist()
    sampler = RejectionSampler(Sampler())
    greedy = SamplingParams(temperature=0, logprobs=1)
    wrong = (argmax[1] + 1) % VOCAB
    out = sampler(logits, _metadata(greedy, 4, 0), [[argmax[0], wrong, argmax[2]]], [None])[0]
    assert out.token_ids == [argmax[0], argmax[1]]
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (3, 1)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([raw[0, argmax[0]].item(), raw[1, argmax[1]].item()], abs=1e-6)
    assert out.top_logprobs[1] is not None and out.top_logprobs[1][0][0] == argmax[1]
    all_pass = sampler(logits, _metadata(greedy, 4, 0), [argmax[:3]], [None])[0]
    assert all_pass.token_ids == argmax  # three accepted plus the bonus
    assert all_pass.num_accepted_tokens == 3


def _speculative_draws(logits, q, one_hot, num_draws):
    """First two output tokens of ``num_draws`` verifications with drafts drawn from ``q`` (or fixed)."""
    sampler = RejectionSampler(Sampler())
    params = SamplingParams(temperature=1.0)
    draft_generator = torch.Generator().manual_seed(2)
    pairs, accepted = [], 0
    for i in range(num_draws):
        if one_hot:
            drafts = [2, 4]
            probs = None
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=draft_generator)) for j in range(2)]
            probs = q
        out = sampler(logits, _metadata(params, 3, make_sampling_key(1, i, ())), [drafts], [probs])[0]
        assert out.num_accepted_tokens <= out.num_draft_tokens == 2
        accepted += out.num_accepted_tokens
        # The second token exists only when the first draft was accepted; it must then follow p_1.
        pairs.append((out.token_ids[0], out.token_ids[1] if len(out.token_ids) > 1 else None))
    return pairs, accepted


def _plain_draws(logits, num_draws, first_tokens):
    """Reference: the first token from p_0; the second from p_1 where the speculative run has one."""
    p = torch.softmax(logits, dim=-1)
    generator = torch.Generator().manual_seed(3)
    first = torch.multinomial(p[0], num_draws, replacement=True, generator=generator).tolist()
    second = torch.multinomial(p[1], len(first_tokens), replacement=True, generator=generator).tolist()
    return first, second


def test_speculative_sampling_preserves_the_target_distribution():
    num_draws = 4000
    logits = _target_logits(2)
    torch.manual_seed(5)
    q = torch.softmax(torch.randn(2, VOCAB) * 1.5, dim=-1)  # a draft that disagrees with the target
    for one_hot in (False, True):
        pairs, accepted = _speculative_draws(logits, q, one_hot, num_draws)
        assert 0 < accepted < 2 * num_draws
        firsts = [a for a, _ in pairs]
        # p_1 is the target's distribution after d_0: compare the second tokens that followed d_0 = first token
        seconds = [b for _, b in pairs if b is not None]
        ref_first, ref_second = _plain_draws(logits, num_draws, seconds)
        assert chi_square_p_value(firsts, ref_first) > P_MIN, f"first token, one_hot={one_hot}"
        assert chi_square_p_value(seconds, ref_second) > P_MIN, f"second token, one_hot={one_hot}"


def test_the_check_tells_a_wrong_distribution_apart():
    """The chi-square check has power: draws from q itself (what accepting every draft would give) fail it."""
    logits = _target_logits(2)
    torch.manual_seed(5)
    q = torch.softmax(torch.randn(2, VOCAB) * 1.5, dim=-1)
    from_q = torch.multinomial(q[0], 4000, replacement=True, generator=torch.Generator().manual_seed(7)).tolist()
    ref_first, _ = _plain_draws(logits, 4000, [0])
    assert chi_square_p_value(from_q, ref_first) < P_MIN


# A synthetic target for trees: the first token ~ softmax(L0), the second given the first x ~ softmax(T[x]).
TREE_NUM_DRAWS = 10_000


def _tree_target():
    generator = torch.Generator().manual_seed(11)
    first = torch.randn(VOCAB, generator=generator) * 1.2
    second = torch.randn(VOCAB, VOCAB, generator=generator) * 1.2
    return first, second


def _tree_draws(one_hot: bool, num_draws: int):
    """(first, second) of ``num_draws`` tree verifications against the synthetic target. Drafts: one-hot, three
    distinct children of the last token (tokens 2, 4, 1) and two under the first (3, 5) and one under the second
    (0); or drawn from ``q``: three children each drawn from ``q[0]``, two grandchildren under the first from
    ``q[1]``. When the verification yields one token (every child rejected) the second is a plain draw from
    ``T[first]``, as the next step would make it."""
    first_logits, second_logits = _tree_target()
    q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(12)) * 1.5, dim=-1)
    sampler = RejectionSampler(Sampler())
    params = SamplingParams(temperature=1.0)
    drafts_generator = torch.Generator().manual_seed(13)
    next_step = torch.Generator().manual_seed(14)
    parents = [-1, -1, -1, 0, 0] + ([1] if one_hot else [])
    pairs, accepted = [], 0
    for i in range(num_draws):
        if one_hot:
            drafts, probs = [2, 4, 1, 3, 5, 0], None
        else:
            top = torch.multinomial(q[0], 3, replacement=True, generator=drafts_generator).tolist()
            below = torch.multinomial(q[1], 2, replacement=True, generator=drafts_generator).tolist()
            drafts, probs = top + below, torch.stack([q[0]] * 3 + [q[1]] * 2)
        # Row 0 after the last token; row c + 1 after node c: depth-1 nodes give T[token], deeper ones anything.
        rows = [first_logits] + [
            second_logits[drafts[c]] if parents[c] < 0 else first_logits for c in range(len(drafts))
        ]
        logits = torch.stack(rows)
        out = sampler(logits, _metadata(params, len(rows), make_sampling_key(1, i, ())), [drafts], [probs], [parents])[
            0
        ]
        accepted += out.num_accepted_tokens
        assert [drafts[node] for node in out.accepted_nodes] == out.token_ids[: out.num_accepted_tokens]
        second = out.token_ids[1] if len(out.token_ids) > 1 else None
        if second is None:
            second = int(torch.multinomial(torch.softmax(second_logits[out.token_ids[0]], -1), 1, generator=next_step))
        pairs.append((out.token_ids[0], second))
    return pairs, accepted


def _plain_pairs(num_draws: int):
    first_logits, second_logits = _tree_target()
    generator = torch.Generator().manual_seed(15)
    firsts = torch.multinomial(torch.softmax(first_logits, -1), num_draws, replacement=True, generator=generator)
    seconds = [
        int(torch.multinomial(torch.softmax(second_logits[x], -1), 1, generator=generator)) for x in firsts.tolist()
    ]
    return list(zip(firsts.tolist(), seconds))


@pytest.mark.parametrize("one_hot", [True, False])
def test_tree_sampling_preserves_the_target_distribution(one_hot):
    pairs, accepted = _tree_draws(one_hot, TREE_NUM_DRAWS)
    assert accepted > 0
    plain = _plain_pairs(TREE_NUM_DRAWS)
    assert chi_square_p_value([a for a, _ in pairs], [a for a, _ in plain]) > P_MIN
    assert chi_square_p_value(pairs, plain) > P_MIN


@pytest.mark.parametrize("one_hot", [True, False])
def test_the_tree_check_fails_a_wrong_acceptance_rule(monkeypatch, one_hot):
    """The same check has power: keeping the residual unchanged after a rejected child (trying every sibling
    against ``p`` itself, the naive multi-draft rule) skews the output, and the test sees it."""
    monkeypatch.setattr(rejection_sampler, "_residual_after_rejection", lambda residual, token, q_child: residual)
    pairs, _ = _tree_draws(one_hot, TREE_NUM_DRAWS)
    plain = _plain_pairs(TREE_NUM_DRAWS)
    assert chi_square_p_value(pairs, plain) < P_MIN


def test_greedy_tree_walks_the_argmax_path():
    logits = torch.full((6, VOCAB), -5.0)
    logits[0, 4] = 5.0  # after the last token: 4 (the second child)
    logits[2, 1] = 5.0  # after node 1 (token 4): 1, which is node 4's token under node 1
    logits[5, 3] = 5.0  # after node 4 (a leaf): the bonus token 3
    drafts, parents = [2, 4, 0, 5, 1], [-1, -1, 0, 1, 1]
    out = RejectionSampler(Sampler())(
        logits, _metadata(SamplingParams(temperature=0, logprobs=0), 6, 0), [drafts], [None], [parents]
    )[0]
    assert out.token_ids == [4, 1, 3]
    assert out.accepted_nodes == [1, 4]
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (5, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([raw[0, 4].item(), raw[2, 1].item(), raw[5, 3].item()], abs=1e-6)
    with pytest.raises(ValueError, match="parent"):
        RejectionSampler(Sampler())(logits, _metadata(SamplingParams(temperature=0), 6, 0), [drafts], [None], [[0] * 5])

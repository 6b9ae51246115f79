"""The rejection sampler (Leviathan et al. 2023) on synthetic distributions: the first output token and
the pair of the first two are distributed as the target's, for model drafts (any ``q``) and one-hot drafts."""

import pytest
import torch

from tests.worker.engine.spec_decode.stats_helpers import chi_square_p_value
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

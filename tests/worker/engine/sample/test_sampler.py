"""Sampler semantics (vLLM's): processing order, support of top-k/top-p/min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sample.sampler import Sampler, compute_prompt_logprobs, make_sampling_key
from worker.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 2
# A small hand-made distribution: top-p / min-p / top-k boundaries below avoid exact ties with these.
DIST = [0.5, 0.25, 0.15, 0.07, 0.03]


def metadata(
    params: list[SamplingParams],
    keys: list[int] | None = None,
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    eos_token_id: int | None = EOS,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        sampling_keys=keys if keys is not None else [make_sampling_key(i, 0, ()) for i in range(n)],
        prompt_token_ids=prompt if prompt is not None else [[] for _ in range(n)],
        output_token_ids=output if output is not None else [[] for _ in range(n)],
        eos_token_id=eos_token_id,
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample_support(params: SamplingParams, num_draws: int = 4000) -> Counter[int]:
    """Token counts of ``num_draws`` draws from DIST, one per sample index of one seeded request."""
    logits = torch.tensor([math.log(p) for p in DIST]).expand(num_draws, -1).contiguous()
    keys = [make_sampling_key(1234, i, ()) for i in range(num_draws)]
    out = Sampler()(logits, metadata([params] * num_draws, keys=keys))
    return Counter(out.sampled_token_ids)


def test_all_greedy_batch_equals_argmax():
    logits = random_logits(16)
    out = Sampler()(logits, metadata([SamplingParams(temperature=0.0)] * 16, keys=[0] * 16))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_among_random_rows_equal_argmax():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    out = Sampler()(logits, metadata(params))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def test_temperature_zero_neutralises_top_p_top_k_min_p():
    logits = random_logits(6)
    params = SamplingParams(temperature=0.0, top_p=0.1, top_k=3, min_p=0.9)
    out = Sampler()(logits, metadata([params] * 6))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy():
    logits = random_logits(32)
    out = Sampler()(logits, metadata([SamplingParams(temperature=1.5, top_k=1)] * 32))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_plain_sampling_reaches_every_token_in_proportion():
    counts = sample_support(SamplingParams(temperature=1.0))
    assert set(counts) == {0, 1, 2, 3, 4}
    for token, p in enumerate(DIST):
        assert abs(counts[token] / 4000 - p) < 0.03


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_p=0.8), {0, 1, 2}),  # mass above token 2 is 0.75 < 0.8; above token 3 is 0.90
        (SamplingParams(top_p=0.7), {0, 1}),
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.10
        (SamplingParams(min_p=0.35), {0, 1}),  # threshold 0.175
        (SamplingParams(top_k=2, top_p=0.6), {0}),  # top-p on the top-k renormalised (2/3, 1/3)
        (SamplingParams(top_k=4, min_p=0.2), {0, 1, 2}),
    ],
)
def test_truncation_keeps_exactly_the_right_support(params, support):
    counts = sample_support(params)
    assert set(counts) == support
    total = sum(DIST[t] for t in support)
    for token in support:
        assert abs(counts[token] / 4000 - DIST[token] / total) < 0.03


def test_top_p_is_computed_after_temperature():
    # At temperature 2 the probabilities flatten to sqrt(p) normalised: 0.34, 0.24, 0.19, 0.13, 0.08,
    # so a nucleus of 0.5 now needs two tokens (it needs one at temperature 1).
    counts = sample_support(SamplingParams(temperature=2.0, top_p=0.5))
    assert set(counts) == {0, 1}


@pytest.mark.parametrize("vocab_size", [512, 1000])
def test_draw_lands_in_every_block_of_a_large_vocabulary(vocab_size):
    # The race skips 64-token blocks that cannot win: every target sits in its own block.
    targets = [3, 300, 500, vocab_size - 1]
    logits = torch.full((4000, vocab_size), -math.inf)
    logits[:, targets] = 0.0
    keys = [make_sampling_key(99, i, ()) for i in range(4000)]
    out = Sampler()(logits, metadata([SamplingParams()] * 4000, keys=keys))
    counts = Counter(out.sampled_token_ids)
    assert set(counts) == set(targets)
    assert all(abs(counts[t] / 4000 - 0.25) < 0.03 for t in targets)


def test_temperature_flattens_the_distribution():
    counts = sample_support(SamplingParams(temperature=2.0))
    flat = [math.sqrt(p) for p in DIST]
    for token, weight in enumerate(flat):
        assert abs(counts[token] / 4000 - weight / sum(flat)) < 0.03


def test_top_p_mixed_with_disabled_rows_leaves_them_untouched():
    logits = torch.tensor([math.log(p) for p in DIST]).expand(2, -1).contiguous()
    probs = Sampler().probs(logits, metadata([SamplingParams(top_p=0.7), SamplingParams()]))
    torch.testing.assert_close(probs[0], torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))
    torch.testing.assert_close(probs[1], torch.tensor(DIST))


def reference_support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """vLLM's truncation rules by full sorts: temperature -> top-k -> top-p -> min-p."""
    scaled = logits / params.temperature
    if params.top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], -math.inf)
    probs, ids = torch.softmax(scaled, dim=-1).sort(descending=True)
    keep = probs > 0
    if params.top_p < 1.0:
        keep &= (probs.cumsum(dim=-1) - probs) < params.top_p
    if params.min_p:
        keep &= probs >= params.min_p * probs[0]
    return set(ids[keep].tolist())


def support_of(probs_row: torch.Tensor) -> set[int]:
    return set(probs_row.nonzero().flatten().tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_support_matches_a_full_sort_even_beyond_the_first_candidates(top_p):
    logits = torch.linspace(0.0, -2.0, 5000)[torch.randperm(5000, generator=torch.Generator().manual_seed(3))]
    params = SamplingParams(top_p=top_p)
    probs = Sampler().probs(logits[None], metadata([params]))
    assert support_of(probs[0]) == reference_support(logits, params)
    assert len(support_of(probs[0])) > 64


def test_mixed_truncation_settings_in_one_batch_match_a_full_sort_per_row():
    params = [
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=300, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, top_p=0.5, min_p=0.02),
        SamplingParams(temperature=2.0, top_p=0.999),
        SamplingParams(temperature=1.1, top_k=7, min_p=0.3),
    ]
    logits = random_logits(len(params), vocab=3000, seed=11)
    probs = Sampler().probs(logits, metadata(params))
    for i, p in enumerate(params):
        assert support_of(probs[i]) == reference_support(logits[i], p), f"row {i}"
        torch.testing.assert_close(probs[i].sum(), torch.tensor(1.0))


def test_penalties_change_logits_as_vllm_defines():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    probs = Sampler().probs(logits, metadata([params], prompt=[[0, 1, 2]], output=[[2, 2, 3]]))
    # Repetition once per seen token {0,1,2,3}: positive / 2, negative * 2; then output counts
    # (token 2 twice, token 3 once) times frequency, and presence once per seen output token.
    expected = torch.tensor([[1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 3.0, 0.0]])
    torch.testing.assert_close(probs.log(), torch.log_softmax(expected, dim=-1))


def test_repetition_penalty_alone_counts_prompt_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    out = Sampler()(logits, metadata([params], prompt=[[0]], output=[[]]))
    assert out.sampled_token_ids == [1]  # 3.0 / 1.5 = 2.0 < 2.9


def test_penalties_leave_unseen_tokens_alone_in_a_padded_batch():
    logits = torch.tensor([[2.0, 1.0, -1.0], [2.0, 1.0, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0)
    probs = Sampler().probs(logits, metadata([params] * 2, prompt=[[], [2, 2, 2]], output=[[], [1]]))
    torch.testing.assert_close(probs[0].log(), torch.log_softmax(logits[0], dim=-1))
    torch.testing.assert_close(probs[1].log(), torch.log_softmax(torch.tensor([2.0, 0.5 - 2.0, -2.0]), dim=-1))


def test_frequency_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert Sampler()(logits, metadata([params], output=[[0]])).sampled_token_ids == [0]  # 2.4 > 2.0
    assert Sampler()(logits, metadata([params], output=[[0, 0]])).sampled_token_ids == [1]  # 1.8 < 2.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_forbids(temperature):
    logits = random_logits(8)
    forced = Sampler()(logits, metadata([SamplingParams(temperature=temperature, logit_bias={7: 100.0})] * 8))
    assert forced.sampled_token_ids == [7] * 8
    argmax = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={a: -100.0}) for a in argmax]
    forbidden = Sampler()(logits, metadata(params))
    assert all(t != a for t, a in zip(forbidden.sampled_token_ids, argmax))


def test_logit_bias_outside_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(random_logits(1), metadata([SamplingParams(logit_bias={VOCAB: 1.0})]))


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 9] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    sampler = Sampler()
    assert sampler(logits, metadata([params], output=[[11, 12]])).sampled_token_ids == [9]
    assert sampler(logits, metadata([params], output=[[11, 12, 13]])).sampled_token_ids == [EOS]


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, metadata([params], output=[[]])).sampled_token_ids == [EOS]


def draw_stream(row_logits: torch.Tensor, seed: int, position: int, neighbours: int, steps: int = 20) -> list[int]:
    """Tokens drawn for one seeded row over ``steps`` steps, placed at ``position`` among other rows."""
    key = make_sampling_key(seed, 0, ())
    tokens: list[int] = []
    for step in range(steps):
        others = random_logits(neighbours, seed=100 + step)
        logits = torch.cat([others[:position], row_logits[None], others[position:]])
        params = [SamplingParams(temperature=0.8 + 0.1 * (j % 3), top_p=0.9) for j in range(neighbours + 1)]
        params[position] = SamplingParams(temperature=1.0, top_k=40, seed=seed)
        keys = [make_sampling_key(None, 0, ()) for _ in range(neighbours + 1)]
        keys[position] = key
        output = [[7] * (step + j) for j in range(neighbours + 1)]
        output[position] = list(tokens)  # the row's counter is its output length
        out = Sampler()(logits, metadata(params, keys=keys, output=output))
        tokens.append(out.sampled_token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_neighbours_and_position():
    row = random_logits(1, seed=7)[0] / 3  # flatter: many plausible tokens
    alone = draw_stream(row, seed=42, position=0, neighbours=0)
    assert draw_stream(row, seed=42, position=3, neighbours=6) == alone
    assert draw_stream(row, seed=42, position=1, neighbours=1) == alone
    assert len(set(alone)) > 3


def test_different_seeds_and_sample_indices_give_different_streams():
    row = random_logits(1, seed=7)[0] / 3
    assert draw_stream(row, seed=42, position=0, neighbours=0) != draw_stream(row, seed=43, position=0, neighbours=0)
    assert make_sampling_key(42, 0, ()) != make_sampling_key(42, 1, ())


def chi_square_uniform(values: list[int], num_bins: int) -> float:
    counts = torch.bincount(torch.tensor(values), minlength=num_bins).double()
    expected = len(values) / num_bins
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value for 7 degrees of freedom at p = 0.001
CHI2_CRIT_7_DOF = 24.32


def test_lines_sharing_a_seed_but_not_a_prompt_draw_independent_samples():
    rng = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 1000, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        for _ in range(64)
    ]
    assert len({tuple(p) for p in prompts}) == 64
    params = SamplingParams(temperature=1.0, seed=1234)
    flat = torch.zeros(64, 8)  # 8 equally likely tokens: each row's token is its draw's rank
    keys = [make_sampling_key(1234, 0, prompt) for prompt in prompts]
    for step in range(3):  # later steps of the same streams: counters 0, 1, 2
        output = [[5] * step for _ in prompts]
        tokens = Sampler()(flat, metadata([params] * 64, keys=keys, output=output)).sampled_token_ids
        assert chi_square_uniform(tokens, 8) < CHI2_CRIT_7_DOF, tokens
    # What the test guards against: a stream that ignores the prompt gives every line one token.
    same_stream = [make_sampling_key(1234, 0, ()) for _ in prompts]
    tokens = Sampler()(flat, metadata([params] * 64, keys=same_stream)).sampled_token_ids
    assert chi_square_uniform(tokens, 8) > CHI2_CRIT_7_DOF


def test_the_stream_depends_on_every_part_of_its_key():
    def first(seed, index, prompt):
        return make_sampling_key(seed, index, prompt)

    base = first(9, 0, [5, 6, 7])
    assert first(9, 0, [5, 6, 7]) == base  # the same request reproduces
    for other in (first(10, 0, [5, 6, 7]), first(9, 1, [5, 6, 7]), first(9, 0, [5, 6]), first(9, 0, [6, 5, 7])):
        assert other != base


def test_make_sampling_key_is_deterministic_when_seeded_only():
    assert make_sampling_key(5, 2, ()) == make_sampling_key(5, 2, ())
    assert make_sampling_key(None, 0, ()) != make_sampling_key(None, 0, ())
    assert all(-(2**63) <= make_sampling_key(seed, 0, (1, 2)) < 2**63 for seed in range(100))


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(4)
    params = [
        SamplingParams(temperature=0.7, top_k=5, presence_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={1: 50.0}, logprobs=0),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=5),
    ]
    out = Sampler()(logits, metadata(params, output=[[3, 4], [], [], [9]]))
    raw = torch.log_softmax(logits, dim=-1)
    expected = [raw[i, t].item() for i, t in enumerate(out.sampled_token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i, k in ((0, 3), (3, 5)):
        values, ids = raw[i].topk(k)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("two_threads")
def test_a_rows_logprobs_and_top_p_support_do_not_depend_on_its_neighbours():
    """At a real vocabulary and 2 threads, torch.logsumexp splits a lone row's sum over the threads but gives each
    thread whole rows in a batch (its bits differed for 12 of 300 such rows): the sampler's normalisers are batch
    invariant (worker/engine/sample/ops/reductions.py), so a seeded line's logprobs and top-p support are its own."""
    vocab, num_rows = 49152, 48
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(3)) * 4
    lse = torch.logsumexp(logits, dim=-1)
    hazards = [r for r in range(num_rows) if not torch.equal(torch.logsumexp(logits[r : r + 1], dim=-1)[0], lse[r])]
    assert hazards  # the rows hold cases where a lone row's torch.logsumexp differs from the batch's
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=42, logprobs=2)] * num_rows
    keys = [make_sampling_key(42, i, ()) for i in range(num_rows)]
    batch = Sampler()(logits, metadata(params, keys=keys))
    prompt = compute_prompt_logprobs(logits, list(range(num_rows)), num_top=2)
    for r in range(num_rows):
        alone = Sampler()(logits[r : r + 1], metadata(params[:1], keys=keys[r : r + 1]))
        assert alone.sampled_token_ids == [batch.sampled_token_ids[r]]
        assert alone.logprobs == [batch.logprobs[r]] and alone.top_logprobs == [batch.top_logprobs[r]]
        assert compute_prompt_logprobs(logits[r : r + 1], [r], num_top=2) == [prompt[r]]
    raw = torch.log_softmax(logits, dim=-1)
    expected = [raw[i, t].item() for i, t in enumerate(batch.sampled_token_ids)]
    assert batch.logprobs == pytest.approx(expected, abs=1e-5)


def test_input_logits_are_not_mutated():
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_p=0.5, logit_bias={0: 5.0}, frequency_penalty=1.0)] * 3
    Sampler()(logits, metadata(params, output=[[1], [2], [3]]))
    assert torch.equal(logits, before)


def test_compute_prompt_logprobs():
    logits = random_logits(5)
    targets = [3, 1, 4, 1, 5]
    result = compute_prompt_logprobs(logits, targets, num_top=2)
    raw = torch.log_softmax(logits, dim=-1)
    for j, (lp, top) in enumerate(result):
        assert lp == pytest.approx(raw[j, targets[j]].item(), abs=1e-5)
        values, ids = raw[j].topk(2)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
    assert all(top == [] for _, top in compute_prompt_logprobs(logits, targets, num_top=0))
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:4], num_top=1)


def test_row_count_mismatch_is_rejected():
    with pytest.raises(ValueError, match="params"):
        Sampler()(random_logits(2), metadata([SamplingParams()]))


def test_unseeded_rows_draw_fresh_random_streams():
    logits = torch.tensor([math.log(p) for p in DIST]).expand(200, -1).contiguous()
    keys = [make_sampling_key(None, 0, ()) for _ in range(200)]
    out = Sampler()(logits, metadata([SamplingParams(top_k=2)] * 200, keys=keys))
    assert set(out.sampled_token_ids) == {0, 1}


def test_race_kernel_and_its_pytorch_twin_agree():
    """The C++ race (pruned blocks, polynomial logs) and the twin on other devices pick the same tokens."""
    from kernels.reference import exponential_race_reference

    logits = random_logits(256, vocab=3000, seed=5)
    logits[:, 1000:] -= 40.0  # most blocks cannot win: the kernel skips them, the twin scores them
    keys = torch.tensor([make_sampling_key(1, i, ()) for i in range(256)])
    counters = torch.arange(256)
    kernel = Sampler()(
        logits, metadata([SamplingParams()] * 256, keys=keys.tolist(), output=[[0] * i for i in range(256)])
    )
    assert kernel.sampled_token_ids == exponential_race_reference(logits, keys, counters).tolist()
